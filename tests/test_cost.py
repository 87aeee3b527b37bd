"""The cost model reproduces published rows and reads a run's measured throughput."""

import json

import pytest

from diffusion import cost


def test_reproduces_mosaicml_8xa100_row(capsys):
    # 1,100 and 290 img/s per 8xA100 node, 2048x550k + 2048x850k samples, $2/GPU-hour
    projection = cost.main(["--per", "node", "--throughput-256", "1100", "--throughput-512", "290",
                            "--samples-256", "2048x550k", "--samples-512", "2048x850k", "--gpus", "8", "--price", "2"])
    assert f"{projection.days:.2f}" == "81.33"
    assert f"{projection.dollars:,.0f}" == "31,230"
    printed = capsys.readouterr().out
    assert "81.33 days" in printed and "$31,230" in printed


def test_defaults_are_the_mosaicml_recipe_and_api_matches_cli():
    projection = cost.project_cost(cost.RECIPE_SAMPLES, {256: 137.5, 512: 36.25}, gpus=8, price_per_gpu_hour=2.0)
    assert round(projection.gpu_hours) == 15_615
    assert [p.resolution for p in projection.phases] == [256, 512]
    assert cost.main([]).dollars == pytest.approx(projection.dollars)


def test_more_gpus_shorten_days_not_cost():
    a = cost.project_cost({256: 10**9}, {256: 100.0}, gpus=8)
    b = cost.project_cost({256: 10**9}, {256: 100.0}, gpus=64)
    assert b.days == pytest.approx(a.days / 8)
    assert b.dollars == pytest.approx(a.dollars)


def test_parse_count():
    assert cost.parse_count("2048x550k") == 1_126_400_000
    assert cost.parse_count("1.13B") == 1_130_000_000
    assert cost.parse_count("1,000") == 1000


def test_missing_throughput_is_named():
    with pytest.raises(ValueError, match="512px"):
        cost.project_cost({256: 1, 512: 1}, {256: 1.0})


def test_from_run_reads_the_last_value_of_a_text_log(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("[batch=10/100]:\n\t throughput/device/samples_per_sec: 12.5\n"
                   "[batch=20/100]:\n\t throughput/device/samples_per_sec: 40.0\n\t loss/train/total: 0.1\n")
    projection = cost.main(["--from-run", f"256={log}", "--samples-512", "0"])
    assert projection.phases[0].samples_per_sec_per_gpu == 40.0
    assert str(log) in capsys.readouterr().out


def test_from_run_reads_json_lines_and_global_rate(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"throughput/samples_per_sec": v}) for v in (80.0, 160.0)))
    assert cost.throughput_from_run(str(metrics), run_gpus=4) == 40.0
    with pytest.raises(ValueError, match="--run-gpus"):
        cost.throughput_from_run(str(metrics))


def test_from_run_finds_a_wandb_summary_in_a_run_dir(tmp_path):
    files = tmp_path / "wandb" / "offline-run-20250101_000000-abc" / "files"
    files.mkdir(parents=True)
    (files / "wandb-summary.json").write_text(json.dumps({"throughput/device/samples_per_sec": 33.0, "_step": 9}))
    assert cost.throughput_from_run(str(tmp_path)) == 33.0


def test_from_run_without_throughput_says_so(tmp_path):
    (tmp_path / "empty.log").write_text("nothing here\n")
    with pytest.raises(ValueError, match="no throughput/device/samples_per_sec"):
        cost.throughput_from_run(str(tmp_path / "empty.log"))
    with pytest.raises(SystemExit):
        cost.main(["--from-run", str(tmp_path / "empty.log")])  # RES= missing
