"""What README's commands write, run as written from the repository root, stays out of git's way: every
output path they name (``--out``, ``--output``, ``trainer.save_folder=``) is one .gitignore covers."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTPUT = re.compile(r"(?:--output[ =]|--out[ =]|trainer\.save_folder=)([^\s`|\\]+)")


def readme_outputs() -> list[str]:
    """The output paths README's commands name, less placeholders (DIR, CKPT) and remote URIs."""
    text = (ROOT / "README.md").read_text()
    found = {m.group(1) for m in OUTPUT.finditer(text)}
    return sorted(p for p in found if not p.isupper() and "://" not in p and not p.startswith("$"))


def test_readme_names_outputs():
    assert "out/grid.png" in readme_outputs() and "raw" in readme_outputs()


def test_every_output_of_a_readme_command_is_ignored_by_git():
    outputs = readme_outputs()
    checked = subprocess.run(["git", "check-ignore", "--no-index", *outputs], cwd=ROOT, capture_output=True, text=True)
    ignored = set(checked.stdout.split())
    assert [p for p in outputs if p not in ignored] == []


def test_generated_images_go_under_out():
    text = (ROOT / "README.md").read_text()
    grids = re.findall(r"diffusion\.generate [^`\n]*--out (\S+)", text)
    assert grids and all(path.startswith("out/") for path in grids), grids
