"""fsdplab.records outside a kernel (a script, a rank), reading records back, and what `fsdplab compare` flags.

The display inside a real kernel is exercised by the lesson runs (tests/lessons/test_notebooks.py reads their
records)."""

import json

import nbformat
import pytest

from fsdplab import records
from fsdplab.records import by_name, check, read, record


@pytest.fixture(autouse=True)
def outside_a_kernel(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("FSDPLAB_RECORDS", raising=False)


def test_record_prints_one_line_and_returns_the_value(capsys):
    assert record("02-bytes", 1234, "B") == 1234
    assert record("02-ratio", 1.5, "x", tolerance=0.05) == 1.5
    record("02-peaks", {"ddp": 2048, "fsdp": [0.123456, 1e9 / 3]}, "B")
    assert capsys.readouterr().out.splitlines() == ["record 02-bytes = 1,234 B", "record 02-ratio = 1.5 x",
                                                    "record 02-peaks = {ddp: 2,048, fsdp: [0.1235, 3.333e+08]} B"]


def test_rank_zero_appends_json_lines_and_other_ranks_record_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv("FSDPLAB_RECORDS", str(path))
    monkeypatch.setenv("RANK", "0")
    record("09-loss", 2.5, claim=3, tolerance="timing", note="step 20")
    check("09-equal", True, "bit-exact")
    monkeypatch.setenv("RANK", "1")
    record("09-other", 7)
    assert capsys.readouterr().out == ""
    got = read(path)
    assert [r["name"] for r in got] == ["09-loss", "09-equal"]
    assert got[0] == {"name": "09-loss", "kind": "value", "value": 2.5, "unit": "", "claim": 3,
                      "tolerance": "timing", "note": "step 20"}
    assert got[1]["kind"] == "check" and got[1]["ok"] is True


def test_check_records_a_failure_then_raises(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv("FSDPLAB_RECORDS", str(path))
    with pytest.raises(AssertionError, match=r"^03-fits: 12 GiB > 10 GiB$"):
        check("03-fits", 12 < 10, "12 GiB > 10 GiB")
    [rec] = read(path)
    assert rec["ok"] is False and records.line(rec) == "check 03-fits FAILED: 12 GiB > 10 GiB"


def test_scalars_become_plain_json_and_other_values_are_refused(monkeypatch):
    torch = pytest.importorskip("torch")
    rec = {}
    monkeypatch.setattr(records, "_emit", rec.update)
    record("01-shape", (torch.tensor(2), 4.0))
    assert rec["value"] == [2, 4.0] and isinstance(rec["value"][0], int)
    with pytest.raises(ValueError, match="cannot be recorded"):
        record("01-t", torch.ones(2))
    for bad in ("bytes", "1-x", "01_x", "01-"):
        with pytest.raises(ValueError, match="NN-short-key"):
            record(bad, 1)
    with pytest.raises(ValueError, match="tolerance"):
        record("01-x", 1, tolerance=-0.1)
    with pytest.raises(ValueError, match="claim"):
        record("01-x", 1, claim="3")


def test_nan_and_infinities_are_recorded_as_json_can_send_them(monkeypatch):
    # A kernel sends a record as JSON; jupyter_client refuses NaN there and prints a warning into the notebook
    # (lesson 09 recorded a logit gap computed from the garbage to_empty leaves, which was once NaN).
    torch = pytest.importorskip("torch")
    rec = {}
    monkeypatch.setattr(records, "_emit", rec.update)
    record("09-gap", {"left": [float("nan"), float("inf")], "fixed": -torch.tensor(float("inf")), "ok": 1e-7})
    assert rec["value"] == {"left": ["nan", "inf"], "fixed": "-inf", "ok": 1e-7}
    json.dumps(rec, allow_nan=False)
    assert records.line(rec) == "record 09-gap = {left: [nan, inf], fixed: -inf, ok: 1e-07}"


def test_a_kernel_record_is_one_display_output_that_read_finds(monkeypatch, tmp_path):
    shown = []
    monkeypatch.setattr(records, "_in_kernel", lambda: True)
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    record("04-overflow", 65504.0, "", claim=9)
    check("04-nan", True)
    assert [raw for _, raw in shown] == [True, True]
    assert shown[0][0]["text/plain"] == "record 04-overflow = 65,504"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output("display_data", data=obj)
                                                        for obj, _ in shown]),
                nbformat.v4.new_markdown_cell("text")]
    nbformat.write(nb, tmp_path / "04.ipynb")
    got = by_name(read(tmp_path / "04.ipynb"))
    assert list(got) == ["04-overflow", "04-nan"] and got["04-overflow"]["claim"] == 9


def test_read_a_runs_records_json_and_by_name_keeps_the_later(tmp_path):
    run = {"lessons": {"01_sharding_math": [{"name": "01-a", "kind": "value", "value": 1},
                                            {"name": "01-a", "kind": "value", "value": 2}]},
           "run_info": {}}
    (tmp_path / "records.json").write_text(json.dumps(run))
    got = read(tmp_path)
    assert [r["lesson"] for r in got] == ["01_sharding_math"] * 2
    assert by_name(got)["01-a"]["value"] == 2


def test_bad_inputs_say_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="fsdplab run"):
        read(tmp_path)
    (tmp_path / "x.jsonl").write_text("{}\nnot json\n")
    with pytest.raises(ValueError, match="line 2"):
        read(tmp_path / "x.jsonl")
    (tmp_path / "records.json").write_text("[]")
    with pytest.raises(ValueError, match="'lessons'"):
        read(tmp_path / "records.json")


# --- fsdplab compare ------------------------------------------------------------------------------------
def value(name, v, tolerance=None):
    return {"name": name, "kind": "value", "value": v, "unit": "", "claim": None, "tolerance": tolerance, "note": ""}


def write_run(folder, lessons, device="CPU only (gloo ranks)"):
    folder.mkdir()
    (folder / "records.json").write_text(json.dumps({"lessons": lessons, "run_info": {"device": device}}))
    return folder


@pytest.mark.parametrize("a, b, tolerance, moved", [
    (1024, 1024, None, False), (1024, 1025, None, True),          # ints exact
    (1.0, 1.0 + 1e-9, None, False), (1.0, 1.0 + 1e-5, None, True),  # floats 1e-6 relative
    (100.0, 104.0, 0.05, False), (100.0, 106.0, 0.05, True),
    (0.0, 0.0, 0.05, False), (float("nan"), float("nan"), None, False), (1.0, float("nan"), 0.5, True),
    ("bf16", "bf16", None, False), ("bf16", "fp32", 0.5, True), (True, 1, None, True),
    ([1, 2.0], [1, 2.0], None, False), ([1, 2], [1, 2, 3], None, True), ([10.0], [10.4], 0.05, False),
    ({"a": 1}, {"a": 2}, None, True), ({"a": 1}, {"b": 1}, None, True),
])
def test_compare_moves_a_value_only_beyond_its_tolerance(a, b, tolerance, moved):
    from fsdplab.runner import compare

    assert compare.status(value("01-x", a, tolerance), value("01-x", b, tolerance)) == (
        compare.MOVED if moved else compare.SAME)


def test_compare_lists_timings_but_never_flags_them_and_names_one_sided_records(tmp_path, capsys):
    from fsdplab.runner import compare

    ok = {"name": "03-fits", "kind": "check", "ok": True, "detail": ""}
    a = write_run(tmp_path / "a", {"03_cpu_offload": [value("03-bytes", 4096), value("03-step", 0.2, "timing"),
                                                      ok, value("03-gone", 1)]})
    b = write_run(tmp_path / "b", {"03_cpu_offload": [value("03-bytes", 8192), value("03-step", 9.0, "timing"),
                                                      dict(ok, ok=False), value("03-same", 1)]},
                  device="1 x NVIDIA H100")
    assert compare.compare(a, b) == 0
    out = capsys.readouterr().out
    table = {line.split()[1]: line.split()[-1] if "only" not in line else " ".join(line.split()[-3:])
             for line in out.splitlines() if line.startswith("03_")}
    assert table == {"03-bytes": "moved", "03-step": "timing", "03-fits": "moved", "03-gone": "only in A",
                     "03-same": "only in B"}
    assert "4 of 5 records moved" in out and "1 x NVIDIA H100" in out and "+100.0%" in out
    assert compare.compare(a, a) == 0 and "agree" not in capsys.readouterr().out   # a's timing is still listed
    assert len(compare.rows(*[compare.load(a)[0]] * 2, everything=True)) == 4


def test_compare_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from fsdplab.runner.cli import main

    write_run(tmp_path / "a", {})
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0], err
