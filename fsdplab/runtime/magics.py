"""`%%ranks`: run a notebook cell on every rank of the running cluster.

    %load_ext fsdplab
    %%ranks                 # all ranks, the cluster's default timeout
    %%ranks -t 30 -r 0,1    # 30 s timeout, ranks 0 and 1 only
    %%ranks --tabs          # this cell's output in one tab per rank (JupyterLab); --lines: labelled lines

Output is printed as it arrives, each line labelled `[rank N]`; a line every rank printed alike is shown
once, as `[ranks 0-7] ...`. `--tabs` (or `Cluster(n, output="tabs")` for every call) shows one tab per
rank instead, where the frontend renders widgets (JupyterLab); elsewhere it falls back to the lines.
Variables a cell defines stay on the ranks for the next cell; `cluster.pull("name")` brings them to the
kernel. An error names the cell's own line (`Cell In[N], line L`).

    %ranks_status           # per rank: pid, host, device, memory in use, what it runs right now
"""

from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError

from .cluster import Cluster


class RanksUsageError(UsageError, ValueError):
    """A `%%ranks` line used wrongly: IPython shows it as one line, without a traceback."""


def ranks_parser():
    """The options of a `%%ranks` line (also read by `fsdplab export`)."""
    parser = argparse.ArgumentParser(prog="%%ranks", add_help=False)
    parser.add_argument("-t", "--timeout", type=float, default=None, help="seconds before RankHang")
    parser.add_argument("-r", "--ranks", default=None, help="comma-separated ranks, e.g. 0,1")
    parser.add_argument("-c", "--cluster", default=None, help="name of the Cluster variable to use")
    view = parser.add_mutually_exclusive_group()
    view.add_argument("--tabs", dest="view", action="store_const", const="tabs",
                      help="this cell's output in one tab per rank (JupyterLab)")
    view.add_argument("--lines", dest="view", action="store_const", const="lines",
                      help="this cell's output as labelled lines, whatever the cluster's output option")
    return parser


def _status_parser():
    parser = argparse.ArgumentParser(prog="%ranks_status", add_help=False)
    parser.add_argument("-c", "--cluster", default=None, help="name of the Cluster variable to use")
    return parser


def ranks_magic(line: str, cell: str, user_ns: dict | None = None):
    __tracebackhide__ = True  # noqa: F841 - IPython shows the cell's frames, not the magic's
    try:
        args = ranks_parser().parse_args(shlex.split(line))
    except SystemExit:
        raise RanksUsageError(f"%%ranks options not understood: {line!r}. "
                         "Use -t SECONDS, -r 0,1, -c NAME, --tabs or --lines.") from None
    cluster = _find_cluster(args.cluster, user_ns or {})
    ranks = None
    if args.ranks:
        try:
            ranks = [int(r) for r in args.ranks.split(",")]
        except ValueError:
            raise RanksUsageError(f"-r takes comma-separated rank numbers like 0,1; got {args.ranks!r}.") from None
    # The ranks compile the body under this cell's own name, one line down (the %%ranks line), so
    # tracebacks and the hang explainer say `Cell In[N], line L` with the notebook's numbers.
    from .tracebacks import current_cell_filename

    filename = current_cell_filename()
    # (A comment, not a blank line: IPython drops leading blank lines before it compiles a cell.)
    source = f"# %%ranks {line}\n{cell}" if filename else cell
    cluster.execute(source, timeout=args.timeout, ranks=ranks, filename=filename, output=args.view)


def _find_cluster(name, user_ns: dict) -> Cluster:
    if name is not None:
        cluster = user_ns.get(name)
        if not isinstance(cluster, Cluster):
            raise RanksUsageError(f"-c {name}: no fsdplab.Cluster named {name!r} in this notebook.")
        return cluster
    running = [v for v in user_ns.values() if isinstance(v, Cluster) and v.running]
    if not running and Cluster.latest() is not None:
        running = [Cluster.latest()]
    if not running:
        raise RanksUsageError("%%ranks needs a running cluster: first `cluster = fsdplab.Cluster(2).start()`.")
    if len({id(c) for c in running}) > 1:
        raise RanksUsageError("several clusters are running: pick one with %%ranks -c NAME.")
    return running[0]


def status_magic(line: str, user_ns: dict | None = None):
    """`%ranks_status [-c NAME]`: the cluster's per-rank table (cluster.status())."""
    try:
        args = _status_parser().parse_args(shlex.split(line))
    except SystemExit:
        raise RanksUsageError(f"%ranks_status options not understood: {line!r}. Use -c NAME.") from None
    _find_cluster(args.cluster, user_ns or {}).status()


def register(ipython) -> None:
    def ranks(line, cell):
        __tracebackhide__ = True  # noqa: F841
        ranks_magic(line, cell, ipython.user_ns)

    def ranks_status(line):
        status_magic(line, ipython.user_ns)

    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    ipython.register_magic_function(ranks_status, magic_kind="line", magic_name="ranks_status")
