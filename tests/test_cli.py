"""Every command as a user runs it: ``--help`` says what it does, with examples and every flag explained; a
user's mistake is one line on stderr naming what was wrong, no traceback.

Each command runs here at least once in a subprocess (its imports' own noise on stderr included): its ``--help``,
and its first mistake. generate's, export's and evaluate's ``--help`` and further mistakes run their ``cli.run``
entry in this process (:func:`run_here`): each subprocess of them pays ~4 s of torch and diffusers imports (their
parsers list the samplers) for output that takes milliseconds."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

COMMANDS = {  # name -> how it is run (after the Python executable)
    "run.py": ["run.py"],
    "diffusion.online": ["-m", "diffusion.online"],
    "laion_to_mds": ["convert/laion_to_mds.py"],
    "download_laion": ["convert/download_laion.py"],
    "diffusion.generate": ["-m", "diffusion.generate"],
    "diffusion.export": ["-m", "diffusion.export"],
    "diffusion.evaluate": ["-m", "diffusion.evaluate"],
    "diffusion.cost": ["-m", "diffusion.cost"],
    "diffusion.kit": ["-m", "diffusion.kit"],
    "diffusion.kit.sample": ["-m", "diffusion.kit.sample"],
    "diffusion.kit.vae_fit": ["-m", "diffusion.kit.vae_fit"],
    "diffusion.demo": ["-m", "diffusion.demo"],
}


def run(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="100", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline",
               RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env.pop("DIFFUSION_DEBUG", None)
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


HERE = {"generate": "diffusion.sample.generate", "export": "diffusion.sample.export",
        "evaluate": "diffusion.sample.evaluate"}  # what ``python -m diffusion.<name>`` runs


def run_here(capfd, prog: str, *args) -> subprocess.CompletedProcess:
    """``python -m diffusion.<prog> ARGS`` as its ``__main__`` runs it (``cli.run(main, prog)``), in this process
    (:func:`cli_helpers.run_entry`), as wide as :func:`run`'s terminal."""
    import importlib
    from cli_helpers import run_entry
    return run_entry(capfd, importlib.import_module(HERE[prog]).main, prog, *args, env={"COLUMNS": "100"})


# ---- --help -------------------------------------------------------------------------------------------

def flags_without_help(help_text: str) -> list[str]:
    """The arguments listed in argparse help sections ("positional arguments:", "options:", and any
    argument group) that have no help text: nothing after the invocation on its line, nor below it."""
    lines = help_text.splitlines()
    missing, in_section = [], False
    for i, line in enumerate(lines):
        if not line.strip():
            in_section = False
            continue
        if not line.startswith(" ") and line.rstrip().endswith(":") and line.strip() != "examples:":
            in_section = not line.startswith("usage:")
            continue
        if not in_section or not re.match(r"  \S", line):  # an entry starts two spaces in
            continue
        invocation, _, rest = line.strip().partition("  ")
        continued = i + 1 < len(lines) and re.match(r" {4,}\S", lines[i + 1]) is not None
        if not rest.strip() and not continued:
            missing.append(invocation)
    return missing


def test_flags_without_help_finds_them():
    import argparse
    parser = argparse.ArgumentParser(prog="x", epilog="examples:\n  x --a 1",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a path")
    parser.add_argument("bare")
    parser.add_argument("--documented-with-a-long-name-and-metavar", metavar="SOME_LONG_METAVAR", help="yes")
    parser.add_argument("--undocumented", type=int)
    parser.add_argument("--switch", action="store_true")
    text = parser.format_help()
    assert flags_without_help(text) == ["bare", "--undocumented UNDOCUMENTED", "--switch"]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_says_what_with_examples_and_explains_every_flag(name, capfd):
    prog = name.removeprefix("diffusion.")
    # generate's, export's and evaluate's parsers load torch (~4 s a process): their --help runs in this process,
    # and each of them runs as a subprocess in test_a_missing_checkpoint_is_one_line_naming_it
    done = run_here(capfd, prog, "--help") if prog in HERE else run(*COMMANDS[name], "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "examples:" in text, text
    assert flags_without_help(text) == [], text
    if name.startswith("diffusion."):
        assert text.startswith(f"usage: python -m {name} "), text.splitlines()[0]
    description = text.split("\n\n")[1]
    assert len(description.split()) >= 8, f"{name}: no description of what it does:\n{text}"
    assert not re.search(r"\bissues? \d", text), f"{name}: an internal issue number in --help"


# ---- one line for a user's mistake -------------------------------------------------------------------------

def assert_one_line_error(done: subprocess.CompletedProcess, prog: str, *named: str) -> str:
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for text in named:
        assert str(text) in lines[0], (text, lines[0])
    return lines[0]


@pytest.fixture
def not_a_checkpoint(tmp_path) -> pathlib.Path:
    path = tmp_path / "notes.pt"
    path.write_text("these are notes, not weights\n")
    return path


@pytest.fixture
def pipeline_dir(tmp_path) -> pathlib.Path:
    """Looks like a diffusers pipeline directory to the up-front checks (they load nothing)."""
    path = tmp_path / "pipeline"
    path.mkdir()
    (path / "model_index.json").write_text("{}")
    return path


def test_a_missing_checkpoint_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "runs" / "latest-rank0.pt"
    for module, extra in (("generate", ["--prompt", "a red circle"]),
                          ("export", ["--out", tmp_path / "exported"]),
                          ("evaluate", ["--prompts-file", "README.md", "--clip-model", tmp_path / "clip"])):
        line = assert_one_line_error(run("-m", f"diffusion.{module}", "--checkpoint", missing, *extra),
                                     module, missing)
        assert "no such checkpoint" in line
    assert not (tmp_path / "exported").exists()


def test_a_file_that_is_no_checkpoint_is_one_line_naming_it(not_a_checkpoint, tmp_path, capfd):
    line = assert_one_line_error(run_here(capfd, "generate", "--checkpoint", not_a_checkpoint,
                                          "--prompt", "x", "--out", tmp_path / "g.png"), "generate", not_a_checkpoint)
    assert "not a checkpoint" in line
    line = assert_one_line_error(run_here(capfd, "export", "--checkpoint", not_a_checkpoint,
                                          "--out", tmp_path / "exported"), "export", not_a_checkpoint)
    assert "not a checkpoint" in line


def test_a_truncated_checkpoint_and_a_checkpoint_folder_are_one_line(tmp_path, capfd):
    import torch
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    torch.save({'state': {'model': {}}}, folder / "ep0-ba10-rank0.pt")
    whole = (folder / "ep0-ba10-rank0.pt").read_bytes()
    (folder / "truncated.pt").write_bytes(whole[: len(whole) // 2])
    os.symlink("ep0-ba10-rank0.pt", folder / "latest-rank0.pt")
    line = assert_one_line_error(run_here(capfd, "generate", "--checkpoint", folder, "--prompt", "x"),
                                 "generate", folder)
    assert f"did you mean {folder / 'latest-rank0.pt'}?" in line
    line = assert_one_line_error(run_here(capfd, "export", "--checkpoint", folder / "truncated.pt",
                                          "--out", tmp_path / "exported"), "export", folder / "truncated.pt")
    assert "not a readable checkpoint" in line


def test_export_refuses_an_out_that_holds_other_files_or_an_earlier_export(pipeline_dir, tmp_path, capfd):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep-me.txt").write_text("mine")
    line = assert_one_line_error(run_here(capfd, "export", "--checkpoint", pipeline_dir, "--out", occupied),
                                 "export", occupied)
    assert "not a pipeline" in line
    assert (occupied / "keep-me.txt").read_text() == "mine" and len(list(occupied.iterdir())) == 1
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "model_index.json").write_text("{}")
    line = assert_one_line_error(run_here(capfd, "export", "--checkpoint", pipeline_dir, "--out", earlier),
                                 "export", earlier)
    assert "--overwrite" in line
    line = assert_one_line_error(run_here(capfd, "export", "--checkpoint", pipeline_dir, "--out", pipeline_dir),
                                 "export", pipeline_dir)
    assert "where the model comes from" in line


def test_export_names_a_file_in_the_way_of_out_before_the_model_loads(pipeline_dir, tmp_path, capsys):
    from diffusion import cli
    from diffusion.sample import export
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(SystemExit):  # was a bare "Not a directory" once the model had loaded
        cli.run(export.main, "export", ["--checkpoint", str(pipeline_dir), "--out", str(tmp_path / "afile" / "sub")])
    assert capsys.readouterr().err == (f"export: error: {tmp_path / 'afile'}: cannot make the folder for --out: "
                                       f"a file is in the way\n")
    assert (tmp_path / "afile").read_text() == "mine"


def test_generate_and_evaluate_name_their_other_inputs(pipeline_dir, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(ROOT)  # README.md below, as the subprocesses' cwd
    empty = tmp_path / "prompts.txt"
    empty.write_text("# only a comment\n\n")
    assert_one_line_error(run_here(capfd, "generate", "--checkpoint", pipeline_dir, "--prompts-file", empty),
                          "generate", empty, "no prompts")
    assert_one_line_error(run_here(capfd, "generate", "--checkpoint", pipeline_dir, "--prompt", "x",
                                   "--out", tmp_path / "grid.jpg"), "generate", "grid.jpg", ".png")
    missing = tmp_path / "no-such-grid.png"
    assert_one_line_error(run_here(capfd, "evaluate", "--images", missing, "--clip-model", tmp_path),
                          "evaluate", missing, "--images")
    assert_one_line_error(run_here(capfd, "evaluate", "--images", "README.md", "--clip-model",
                                   tmp_path / "no-clip"), "evaluate", tmp_path / "no-clip", "--clip-model")


def test_generate_at_a_size_no_memory_holds_is_one_line_naming_the_size_and_batch(tiny_kit, tmp_path, capfd):
    """The tiny kit's UNet asked for 400,000 px a side: its first allocation (the initial noise, 40 GB) fails, as
    a run far past the trained size does on any machine. This process's address space is capped above what it
    maps for the call, so the allocation fails whatever the machine's overcommit policy."""
    import resource
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limits = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 8 * 2 ** 30, limits[1]))
    try:
        done = run_here(capfd, "generate", "--checkpoint", tiny_kit, "--prompt", "a red circle", "--steps", "1",
                        "--width", "400000", "--height", "400000", "--batch-size", "2", "--out", tmp_path / "grid.png")
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    line = assert_one_line_error(done, "generate", "400000x400000 images 2 at a time", "--batch-size")
    assert "GiB failed" in line and not (tmp_path / "grid.png").exists()


def test_train_names_a_missing_yaml_and_a_misspelt_key(tmp_path):
    assert_one_line_error(run("run.py", tmp_path / "nope.yaml"), "run.py", tmp_path / "nope.yaml")
    assert_one_line_error(run("run.py", "yamls/tiny-cpu.yaml", "optimizer.lrr=1e-3"), "run.py", "optimizer.lrr")


def test_convert_and_download_name_a_missing_input(tmp_path):
    assert_one_line_error(run("convert/laion_to_mds.py", "--input", tmp_path / "nope", "--output", tmp_path / "mds",
                              "--model", tmp_path / "model"), "laion_to_mds", tmp_path / "nope")
    assert_one_line_error(run("convert/download_laion.py", "--input", tmp_path / "nope", "--output",
                              tmp_path / "raw"), "download_laion", tmp_path / "nope")
    assert not (tmp_path / "mds").exists() and not (tmp_path / "raw").exists()


# ---- no advice noise when models load ---------------------------------------------------------------------

def test_model_loading_drops_diffusers_advice_but_not_real_warnings(tiny_kit):
    import logging

    import torch

    from diffusion.models import loading

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    # diffusers' loggers do not propagate to the root: listen where its own handler sits, whatever
    # logging setup earlier tests in this process (Ray, Composer) left behind
    records, library = Records(), logging.getLogger("diffusers")
    library.addHandler(records)
    try:
        vae = loading.load_vae(tiny_kit)
        vae.to(dtype=torch.float16)  # diffusers warns about an empty list of float32 modules
        logging.getLogger("diffusers.models.modeling_utils").warning("a real warning stays")
    finally:
        library.removeHandler(records)
    text = "\n".join(records.messages)
    assert "accelerate" not in text and "kept in float32: []" not in text, text
    assert "a real warning stays" in text


def test_a_full_disk_inside_a_sharded_checkpoint_save_is_one_line(capsys):
    """torch wraps each rank's error in a CheckpointException (a BaseException); a full disk in there is
    still the user's one line, exit 2, and anything else inside stays a traceback."""
    import errno
    from torch.distributed.checkpoint.api import CheckpointException
    from diffusion import cli

    def save_on_a_full_disk(argv):
        full = OSError(errno.ENOSPC, "No space left on device", "ckpt/ep0-ba4/__0_0.distcp")
        raise CheckpointException("save", {0: (full, None)})

    with pytest.raises(SystemExit) as exited:
        cli.run(save_on_a_full_disk, "run.py", [])
    assert exited.value.code == 2
    assert capsys.readouterr().err == "run.py: error: ckpt/ep0-ba4/__0_0.distcp: No space left on device\n"

    def a_bug(argv):
        raise CheckpointException("save", {0: (ZeroDivisionError("bug"), None)})
    with pytest.raises(CheckpointException):
        cli.run(a_bug, "run.py", [])


def test_a_file_in_the_way_of_a_folder_says_so(tmp_path, capsys):
    """Commands that make their --out folder (here the sample data's) said a bare "Not a directory"."""
    from diffusion import cli
    from diffusion.kit import sample
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        cli.run(sample.main, "sample", ["--out", str(tmp_path / "notes.txt" / "data"), "--n", "4"])
    assert capsys.readouterr().err == (f"sample: error: {tmp_path / 'notes.txt' / 'data'}: a file is in the way: a "
                                       f"name on this path is a file, not a folder\n")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_demo_names_a_kit_that_is_a_file_before_drawing_the_sample_data(tmp_path, capsys):
    """``--kit FILE`` failed only after the sample data was drawn, in two lines."""
    from diffusion import cli, demo
    (tmp_path / "kit").write_text("mine")
    with pytest.raises(SystemExit):
        cli.run(demo.main, "demo", ["--out", str(tmp_path / "out"), "--kit", str(tmp_path / "kit")])
    assert capsys.readouterr().err == (f"demo: error: {tmp_path / 'kit'}: --kit is a file; give the kit's directory "
                                       f"(built there if missing)\n")
    assert not (tmp_path / "out").exists() and (tmp_path / "kit").read_text() == "mine"
