"""Errors and hang reports name the notebook's cells, `Cell In[N], line L` with the source line, whatever the
serializer does to the code it ships (cloudpickle 3.1.3 names every shipped code object's file
`<dynamic-code>`) and however IPython counts cells (IPython 9 counts up before a cell runs, IPython 8 after).

Each test runs its cells in IPython's own test shell, as a notebook would, against the shared 2-rank cluster."""

import re

import cloudpickle
import IPython
import pytest

import fsdplab
from fsdplab.runtime.errors import strip_ansi


@pytest.fixture(scope="module")
def shell(cluster):
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.user_ns.update(cluster=cluster, fsdplab=fsdplab)
    fsdplab.load_ipython_extension(shell)
    print(f"cloudpickle {cloudpickle.__version__}, IPython {IPython.__version__}")
    return shell


def cell(shell, source: str):
    """Run `source` as the next notebook cell: (its number N in In[N], the exception it raised or None)."""
    number = shell.execution_count
    result = shell.run_cell(source, store_history=True)
    return number, result.error_in_exec


def _no_dynamic_code(error):
    for failure in getattr(error, "failures", {}).values():
        files = [frame[0] for frame in failure.frames]
        assert not any("dynamic-code" in f for f in files), files


def test_a_function_from_a_cell(shell):
    defined, _ = cell(shell, "def f():\n    if fsdplab.rank() == 1:\n        raise KeyError('in f')\n")
    _, error = cell(shell, "cluster.run(f)")
    assert isinstance(error, fsdplab.RankError), error
    assert str(error).splitlines()[0] == f"rank 1: KeyError: 'in f'  (Cell In[{defined}], line 3)", str(error)
    assert "raise KeyError('in f')" in str(error)
    _no_dynamic_code(error)


def test_a_lambda_from_a_cell(shell):
    defined, _ = cell(shell, "# a lambda on line 2\ng = lambda: 1 / 0\n")
    _, error = cell(shell, "cluster.run(g)")
    assert f"ZeroDivisionError: division by zero  (Cell In[{defined}], line 2)" in str(error), str(error)
    assert "g = lambda: 1 / 0" in str(error)
    _no_dynamic_code(error)


def test_a_nested_function_and_a_helper_from_an_earlier_cell(shell):
    helper, _ = cell(shell, "def helper(x):\n    return {}[x]\n")
    defined, _ = cell(shell, "def outer():\n    def inner(x):\n        return helper(x + 1)\n    return inner(1)\n")
    _, error = cell(shell, "cluster.run(outer)")
    text = str(error)
    assert f"KeyError: 2  (Cell In[{helper}], line 2)" in text.splitlines()[0], text
    for where in (f"Cell In[{defined}], line 4, in outer", f"Cell In[{defined}], line 3, in inner",
                  f"Cell In[{helper}], line 2, in helper"):
        assert where in text, text
    _no_dynamic_code(error)


def test_methods_of_a_class_from_a_cell(shell):
    defined, _ = cell(shell, "class Step:\n    def __init__(self, scale):\n        self.scale = scale\n\n"
                             "    def run(self):\n        return self.scale / 0\n")
    _, error = cell(shell, "cluster.run(Step(2).run)")  # a bound method
    assert f"(Cell In[{defined}], line 6)" in str(error).splitlines()[0], str(error)
    assert "return self.scale / 0" in str(error)
    _no_dynamic_code(error)
    user, _ = cell(shell, "def use(step):\n    return step.run()\n")
    _, error = cell(shell, "cluster.run(use, Step(3))")  # an instance passed as an argument
    assert f"Cell In[{user}], line 2, in use" in str(error) and f"Cell In[{defined}], line 6, in run" in str(error)
    _no_dynamic_code(error)
    _, error = cell(shell, "cluster.push(use_later=lambda: Step(4).run())\n"
                           "cluster.execute('use_later()')")  # pushed, then called from source
    assert f"Cell In[{defined}], line 6, in run" in str(error), str(error)


def test_a_ranks_cell_and_execute_source(shell):
    number, error = cell(shell, "%%ranks\nx = 1\nif rank() == 1:\n    raise KeyError('from the cell')\n")
    assert isinstance(error, fsdplab.RankError)
    assert f"rank 1: KeyError: 'from the cell'  (Cell In[{number}], line 4)" in str(error), str(error)
    assert "raise KeyError('from the cell')" in str(error)
    number, error = cell(shell, "cluster.execute('y = 2\\nraise ValueError(y)')")
    assert f"(line 2 of the code Cell In[{number}] ran on the ranks)" in str(error).splitlines()[0], str(error)
    assert "ranks source" not in str(error), str(error)


def test_the_notebook_shows_the_users_frames_only(shell):
    cell(shell, "def bad():\n    raise RuntimeError('from a rank')\n")
    number, error = cell(shell, "out = cluster.run(bad)")
    text = strip_ansi("\n".join(error._render_traceback_()))
    assert f"Cell In[{number}], line 1" in text and "out = cluster.run(bad)" in text, text
    assert "call.py" not in text and "cluster.py" not in text and "fsdplab" + "/" not in text, text
    assert "ranks 0-1: RuntimeError: from a rank" in text, text
    number, error = cell(shell, "%%ranks\nraise RuntimeError('in a ranks cell')\n")
    text = strip_ansi("\n".join(error._render_traceback_()))
    assert f"(Cell In[{number}], line 2)" in text and "raise RuntimeError('in a ranks cell')" in text, text
    assert "run_cell_magic" not in text, text      # IPython's call of the magic: the whole cell as one string
    assert "interactiveshell.py" not in text and "magics.py" not in text and "fsdplab" + "/" not in text, text


def test_a_ranks_cell_used_wrongly_is_one_line(shell):
    from IPython.core.error import UsageError

    for source, says in (("%%ranks -x\npass\n", "%%ranks options not understood"),
                         ("%%ranks -r one\npass\n", "-r takes comma-separated rank numbers"),
                         ("%%ranks -c nothing\npass\n", "no fsdplab.Cluster named 'nothing'")):
        _, error = cell(shell, source)
        assert isinstance(error, UsageError) and isinstance(error, ValueError), repr(error)  # IPython: one line
        assert says in str(error), str(error)


def test_hangs_and_status_name_the_cell(shell, cluster, capsys):
    defined, _ = cell(shell, "import torch\n\ndef stuck():\n    if fsdplab.rank() == 0:\n"
                             "        torch.distributed.all_reduce(torch.ones(1))\n")
    _, error = cell(shell, "cluster.run(stuck, timeout=2)")
    assert isinstance(error, fsdplab.RankHang), error
    assert re.search(rf"rank 0 waits in all_reduce #\d+ .* at Cell In\[{defined}\], line 5", error.states[0]), error
    assert f"Cell In[{defined}], line 5, in stuck" in str(error), str(error)
    rows = cluster.status()
    assert f"at Cell In[{defined}], line 5" in rows[0]["running"], rows
    cluster.restart()
    number, error = cell(shell, "%%ranks -t 2\nif rank() == 0:\n    dist.all_reduce(torch.ones(1))\n")
    assert isinstance(error, fsdplab.RankHang), error
    assert f"at Cell In[{number}], line 3" in error.states[0], error.states
    cluster.restart()
