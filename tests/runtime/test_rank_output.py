"""Per-rank output in tabs: Echo(view="tabs") driven with fake results in a simulated widget frontend.

The frontend is simulated by saying widgets render (`widgets_missing` -> None) and catching what would be
displayed; the widgets are real ipywidgets objects (outside a kernel their messages go nowhere), and
updates are counted by observing the value each rank's page sends.
"""

import io

import pytest

from fsdplab.runtime import output as rank_output
from fsdplab.runtime.cluster import Cluster
from fsdplab.runtime.magics import ranks_parser, ranks_magic
from fsdplab.runtime.output import Echo


class Result:
    """What Echo reads from an ipyparallel result: the text each stream has printed so far."""

    def __init__(self, stdout="", stderr=""):
        self.stdout, self.stderr = stdout, stderr


@pytest.fixture
def frontend(monkeypatch):
    """A frontend that renders widgets: returns the list of widgets displayed."""
    shown = []
    monkeypatch.setattr(rank_output, "widgets_missing", lambda: None)
    monkeypatch.setattr(rank_output, "_display", shown.append)
    return shown


def _count_updates(tabs) -> list:
    """A one-element list holding how many values the ranks' pages have sent since this call."""
    count = [0]
    for page in tabs.pages.values():
        page.observe(lambda change: count.__setitem__(0, count[0] + 1), "value")
    return count


def test_each_rank_gets_its_own_tab_with_its_lines_and_marked_stderr(frontend):
    out = io.StringIO()
    echo = Echo(True, view="tabs", out=out)
    echo.update({0: Result("loss 2.31\nrank zero\n"), 1: Result("loss 2.31\n", "warning: slow\n")}, final=True)
    assert len(frontend) == 1 and frontend[0] is echo.tabs.widget
    assert list(echo.tabs.widget.titles) == ["rank 0", "rank 1"]
    assert echo.tabs.text(0) == "loss 2.31\nrank zero"
    assert echo.tabs.text(1) == "loss 2.31\n[stderr] warning: slow"
    page = echo.tabs.pages[1].value
    assert "warning: slow" in page and page.index("[stderr]") < page.index("warning: slow")
    assert out.getvalue() == ""  # nothing printed as lines when the tabs show it


def test_tabs_follow_the_ranks_of_the_call_and_keep_partial_lines_until_they_end(frontend):
    echo = Echo(True, view="tabs")
    result = Result("step 1\nstep ")
    echo.update({2: result, 3: Result()})
    assert list(echo.tabs.widget.titles) == ["rank 2", "rank 3"]
    assert echo.tabs.text(2) == "step 1"
    result.stdout += "2\n<html> & more"
    echo.update({2: result, 3: Result()}, final=True)
    assert echo.tabs.text(2) == "step 1\nstep 2\n<html> & more"
    assert "&lt;html&gt; &amp; more" in echo.tabs.pages[2].value  # shown as text, not markup


def test_a_call_that_prints_nothing_makes_no_widget(frontend, monkeypatch):
    import ipywidgets

    made = []
    monkeypatch.setattr(ipywidgets.Widget, "_widget_construction_callback", made.append)
    echo = Echo(True, view="tabs")
    echo.update({0: Result(), 1: Result()})
    echo.update({0: Result(), 1: Result()}, final=True)
    assert frontend == [] and made == []
    echo.update({0: Result("now something\n"), 1: Result()}, final=True)
    assert frontend == [echo.tabs.widget] and made  # the check above can see widgets being made


def test_at_most_one_update_per_rank_per_poll_however_many_lines(frontend, monkeypatch):
    monkeypatch.setattr(rank_output, "TAB_REFRESH_S", 0.0)  # redraw at every poll: the worst case
    results = {r: Result() for r in range(2)}
    echo = Echo(True, view="tabs")
    polls, per_poll = 50, 1000
    results[0].stdout = "start\n"
    echo.update(results)
    count = _count_updates(echo.tabs)
    for p in range(polls):
        for r, res in results.items():
            res.stdout += "".join(f"rank {r} line {p * per_poll + i}\n" for i in range(per_poll))
        echo.update(results)
    echo.update(results, final=True)
    assert count[0] <= 2 * polls            # one per changed tab per poll, never one per line
    assert count[0] < 2 * polls * per_poll / 100
    assert echo.tabs.text(0).endswith(f"rank 0 line {polls * per_poll - 1}")


def test_redraws_are_throttled_between_polls(frontend, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(rank_output.time, "monotonic", lambda: clock[0])
    res = Result("first\n")
    echo = Echo(True, view="tabs")
    echo.update({0: res})
    count = _count_updates(echo.tabs)
    for i in range(20):                      # 20 polls within one refresh interval: no redraw
        clock[0] += rank_output.TAB_REFRESH_S / 40
        res.stdout += f"line {i}\n"
        echo.update({0: res})
    assert count[0] == 0
    echo.update({0: res}, final=True)        # the end of the call always shows everything
    assert count[0] == 1 and echo.tabs.text(0).endswith("line 19")


def test_a_tab_keeps_the_last_lines_and_says_how_many_it_dropped(frontend, monkeypatch):
    monkeypatch.setattr(rank_output, "TAB_LINES", 100)
    n = 100_000
    res = Result()
    echo = Echo(True, view="tabs")
    for chunk in range(10):
        res.stdout += "".join(f"line {i}\n" for i in range(chunk * n // 10, (chunk + 1) * n // 10))
        echo.update({0: res})
    echo.update({0: res}, final=True)
    lines = echo.tabs.text(0).splitlines()
    assert lines[0] == f"… {n - 100} earlier lines not shown"
    assert lines[1:] == [f"line {i}" for i in range(n - 100, n)]
    assert f"{n - 100} earlier lines not shown" in echo.tabs.pages[0].value
    assert len(echo.tabs.pages[0].value) < 100 * 20   # the page holds the kept lines only


def test_without_a_widget_frontend_tabs_fall_back_to_lines_with_one_note(monkeypatch):
    monkeypatch.setattr(rank_output, "widgets_missing", lambda: "not in a Jupyter kernel")
    monkeypatch.setattr(rank_output, "_fallback_said", False)
    monkeypatch.setattr(rank_output, "_display", lambda w: pytest.fail("a widget was displayed"))
    outputs = []
    for _ in range(2):
        out = io.StringIO()
        echo = Echo(True, view="tabs", out=out)
        echo.update({0: Result("loss 2.31\n"), 1: Result("loss 2.31\n")}, final=True)
        outputs.append(out.getvalue().splitlines())
        assert echo.tabs is None
    assert outputs[0][-1] == outputs[1][-1] == "[ranks 0-1] loss 2.31"
    notes = [line for lines in outputs for line in lines if "not in a Jupyter kernel" in line]
    assert len(notes) == 1 and len(outputs[0]) == 2 and len(outputs[1]) == 1


def test_a_quiet_or_lines_echo_never_asks_for_widgets(monkeypatch):
    monkeypatch.setattr(rank_output, "widgets_missing", lambda: pytest.fail("asked about widgets"))
    out = io.StringIO()
    Echo(False, view="tabs", out=out).update({0: Result("hidden\n")}, final=True)
    Echo(True, view="lines", out=out).update({0: Result("shown\n")}, final=True)
    assert out.getvalue() == "[rank 0] shown\n"


def test_widgets_do_not_render_in_scripts_or_fsdplab_run(monkeypatch):
    monkeypatch.delenv("FSDPLAB_OUT", raising=False)
    assert "Jupyter kernel" in rank_output.widgets_missing()   # pytest: no kernel
    monkeypatch.setenv("FSDPLAB_OUT", "/somewhere")
    assert "fsdplab run" in rank_output.widgets_missing()


def test_widgets_render_only_in_a_kernel_started_by_jupyterlab(monkeypatch):
    class ZMQInteractiveShell:
        pass

    import IPython

    monkeypatch.delenv("FSDPLAB_OUT", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: ZMQInteractiveShell())
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert "papermill" in rank_output.widgets_missing()
    monkeypatch.setenv("JPY_SESSION_NAME", "/lab/00_start_here.ipynb")
    assert rank_output.widgets_missing() is None


def test_ranks_magic_tabs_and_lines_options_apply_to_one_cell(monkeypatch):
    cluster = Cluster(2, output="lines")
    seen = []
    # the view each call uses: its own output= or, without one, the cluster's option
    monkeypatch.setattr(cluster, "execute", lambda *a, **k: seen.append(k.get("output") or cluster.output))
    ns = {"c": cluster}
    ranks_magic("-c c --tabs", "print(rank())", ns)
    ranks_magic("-c c", "print(rank())", ns)
    cluster.output = "tabs"
    ranks_magic("-c c --lines -t 5", "print(rank())", ns)
    assert seen == ["tabs", "lines", "lines"] and cluster.output == "tabs"
    assert ranks_parser().parse_args(["-r", "0,1", "--tabs"]).view == "tabs"
    with pytest.raises(ValueError, match="--tabs or --lines"):
        ranks_magic("-c c --tabs --lines", "pass", ns)


def test_ranks_magic_restores_the_option_when_the_cell_fails(monkeypatch):
    cluster = Cluster(2)

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cluster, "execute", fail)
    with pytest.raises(RuntimeError):
        ranks_magic("-c c --tabs", "pass", {"c": cluster})
    assert cluster.output == "lines"


def test_ranks_status_magic_takes_only_the_cluster_name(monkeypatch):
    from fsdplab.runtime.magics import status_magic

    cluster = Cluster(2)
    calls = []
    monkeypatch.setattr(cluster, "status", lambda: calls.append("status"))
    status_magic("-c c", {"c": cluster})
    assert calls == ["status"]
    with pytest.raises(ValueError, match="-c NAME"):
        status_magic("-c c --tabs", {"c": cluster})


class LateOutput:
    """A finished call whose printed text has not arrived yet (it comes on another channel than the
    result): it arrives when the caller waits for the output, as ipyparallel's AsyncResult does."""

    def __init__(self, text):
        self._text, self.stdout, self.stderr = text, "", ""

    def ready(self):
        return True

    def wait_for_output(self, timeout):
        self.stdout = self._text
        return True

    def get(self, timeout):
        return None


def test_the_last_lines_of_a_call_are_shown_even_when_they_arrive_after_its_result(capsys):
    from fsdplab.runtime import call
    from fsdplab.runtime.output import Echo

    class Group:   # two ranks that stay alive
        world_size = 2

        def dead(self):
            return []

    call.wait(Group(), {0: LateOutput("my shard [0.0]\n"), 1: LateOutput("my shard [1.0]\n")}, 5,
              Echo(enabled=True, view="lines"))
    out = capsys.readouterr().out
    assert "[rank 0] my shard [0.0]" in out and "[rank 1] my shard [1.0]" in out
