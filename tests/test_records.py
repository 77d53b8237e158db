"""fsdplab.records outside a kernel (a script, a rank), reading records back, and what `fsdplab compare` flags.

The display inside a real kernel is exercised by the lesson runs (tests/test_notebooks.py reads their records)."""

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
    assert capsys.readouterr().out.splitlines() == ["record 02-bytes = 1,234 B", "record 02-ratio = 1.5 x"]


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
