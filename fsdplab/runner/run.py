"""What `fsdplab run` does: each lesson through papermill in a kernel of its own, sharing one fork server, one
estimate cache and the estimates made ahead; the executed notebook put in place whole; a summary row per lesson."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path

from . import site
from . import estimates_ahead, forkserver


def declared_parameters(path) -> list:
    """The names a lesson's cell tagged `parameters` declares, as papermill reads them."""
    import papermill as pm

    return list(pm.inspect_notebook(str(path)))


@contextlib.contextmanager
def _environment(**values):
    """Set environment variables (inherited by the kernel and its ranks) for the duration of a block."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _remove_scratch(folder: Path) -> None:
    """Remove a lesson's temporary folder once the processes that write into it are gone.

    A kernel stopped after a failed cell leaves its cluster's scratch folder behind (rank logs, pid file);
    the cluster's watcher kills the ranks within a second of the kernel's exit, so wait for them first."""
    import psutil

    pids = []
    for pidfile in folder.glob("*/pids"):
        try:
            pids += [int(pid) for pid in pidfile.read_text().split()]
        except (OSError, ValueError):
            pass
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
    for _ in range(5):   # a process that just exited may still be closing a log file
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
        time.sleep(0.5)


class StopSignals:
    """Ctrl-C and SIGTERM during a run. The first stops the lesson that runs (a KeyboardInterrupt
    where papermill waits on its kernel) or, between lessons, the run before the next one; later
    ones only say that the run is stopping: what the first one started (kernel, ranks, temporary
    folders, the summary) is never cut short, so a second Ctrl-C leaves no traceback or folder."""

    def __init__(self):
        self.signum = None
        self.armed = False     # inside `interruptible`, where a KeyboardInterrupt is caught
        self.noted = False

    def handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            if self.armed:
                raise KeyboardInterrupt
        elif not self.noted:
            self.noted = True
            # os.write, not print: the main thread may be inside a print to the same stream
            os.write(2, b"fsdplab: stopping: ending the lesson's kernel and removing its temporary "
                        b"files; the summary follows\n")

    @contextlib.contextmanager
    def interruptible(self):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.armed = True
        try:
            yield
        finally:
            self.armed = False


_stop = None   # the run's StopSignals while `stop_signals` holds the handlers


@contextlib.contextmanager
def stop_signals():
    """SIGINT and SIGTERM as StopSignals for a run (main thread only; elsewhere nothing changes).
    After a stop both are ignored from then on: the process is ending, and a late signal must not
    become a traceback, or a death by SIGINT while the interpreter shuts down (which puts Python's
    own handlers back to the default action)."""
    global _stop
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = StopSignals()
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.signal(signum, stop.handle) for signum in signums}
    _stop = stop
    try:
        yield stop
    finally:
        _stop = None
        for signum, handler in previous.items():
            signal.signal(signum, handler if stop.signum is None else signal.SIG_IGN)


def _interruptible():
    return _stop.interruptible() if _stop is not None else contextlib.nullcontext()


def _stop_requested() -> bool:
    return _stop is not None and _stop.signum is not None


# What a run makes in the temporary folder; each holds OWNER_FILE, naming the process it belongs to.
TEMP_PREFIXES = ("fsdplab-run-", "fsdplab-forkserver-", "fsdplab-estimates-")
OWNER_FILE = ".fsdplab-owner"


def _process_start(pid: int):
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def owned_temp_dir(prefix: str, folder=None) -> str:
    """tempfile.mkdtemp, with OWNER_FILE naming this process (pid and start time): a later run
    removes the folder once that process is gone (`remove_stale_temp`)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=folder)
    owner = {"pid": os.getpid(), "started": _process_start(os.getpid())}
    Path(path, OWNER_FILE).write_text(json.dumps(owner))
    return path


def _owner_alive(folder: str) -> bool:
    """Whether the process named by `folder`'s OWNER_FILE runs (True when the file cannot be read: a
    folder this release did not make is never taken for a dead run's)."""
    try:
        fd = os.open(os.path.join(folder, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as handle:
            owner = json.loads(handle.read(4096))
        pid, started = int(owner["pid"]), owner["started"]
    except (OSError, ValueError, KeyError, TypeError):
        return True
    now = _process_start(pid)
    # a pid the system gave to another process since is the owner's end, too
    return now is not None and (started is None or abs(now - float(started)) < 1.0)


def remove_stale_temp(folders=None) -> list:
    """Remove what killed runs left in the temporary folders: entries named by TEMP_PREFIXES, real
    folders (not links) owned by this user, whose OWNER_FILE names a process that is gone. Returns
    the removed paths. Another live run's folders, and anything else, stay."""
    removed = []
    folders = folders or [tempfile.gettempdir(), forkserver.short_temp_dir()]
    for folder in dict.fromkeys(folders):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not name.startswith(TEMP_PREFIXES):
                continue
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _owner_alive(path):
                continue
            try:
                shutil.rmtree(path)   # refuses a link in its place, and follows none inside
                removed.append(path)
            except OSError:
                pass
    return removed


def figures_folder(figures, out) -> Path:
    """Where the lessons save figures: `figures` if given, else $FSDPLAB_FIGURES, else `out`/figures."""
    return Path(figures or os.environ.get("FSDPLAB_FIGURES") or Path(out) / "figures").resolve()


def run_lessons(paths, out_dir="runs", world_size=None, parameters=None, progress=True, figures=None) -> list:
    """Execute each notebook with papermill into `out_dir`; returns rows of (lesson, status, seconds, detail).

    The kernel runs in `out_dir` with FSDPLAB_OUT=`out_dir` (where a lesson writes the files it keeps) and
    FSDPLAB_FIGURES=`figures` (default: the user's FSDPLAB_FIGURES, else `out_dir`/figures); its temporary
    files go to a folder of its own that is removed when the lesson ends, failed or not. The lessons share
    one FSDPLAB_ESTIMATE_CACHE (the user's, else a temporary one removed at the end), and their ranks are
    forks of one fork server (fsdplab.runner.forkserver) that lives as long as the run, as are their kernels;
    where FSDPLAB_FORKSERVER names a server that is running already (a caller's, shared by its runs), the run
    forks from that one and leaves it running."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    info = site.run_info()
    (out / "run_info.json").write_text(json.dumps(info))   # the machine, for `fsdplab site`
    figures = figures_folder(figures, out)
    # One estimate cache for the whole run: lessons that estimate the same setting exactly do it once.
    remove_stale_temp()
    own_cache = (None if os.environ.get("FSDPLAB_ESTIMATE_CACHE")
                 else owned_temp_dir("fsdplab-estimates-"))
    ahead = server = server_dir = None
    outer = forkserver.running()   # a server the caller started and shares between its runs
    scratches = []   # each lesson's temporary folder, removed again once the server's forks are gone
    try:
        with _environment(**({"FSDPLAB_ESTIMATE_CACHE": own_cache} if own_cache else {})):
            # The lessons' ranks are forks of one process that imported torch once (fsdplab.runner.forkserver).
            if forkserver.available() and not outer:
                server_dir = owned_temp_dir("fsdplab-forkserver-", forkserver.short_temp_dir())
                server = forkserver.start(server_dir)
            if len(paths) > 1 and not parameters:
                # later lessons' full-scale estimates, made in the time the lessons leave idle
                # (fsdplab.runner.estimates_ahead)
                ahead = estimates_ahead.start(paths, os.environ["FSDPLAB_ESTIMATE_CACHE"])
            # The kernels are forks of the server too: a `python3` kernel spec found before the installed one.
            serving = forkserver.running()   # the caller's server, or the one started above
            specs = [forkserver.kernel_spec(os.path.dirname(serving))] if serving else []
            jupyter_path = os.pathsep.join(specs + [p for p in [os.environ.get("JUPYTER_PATH")] if p])
            with _environment(**({"JUPYTER_PATH": jupyter_path} if jupyter_path else {})):
                rows = []
                for i, path in enumerate(paths, 1):
                    if _stop_requested():   # stopped between lessons: the rest do not start
                        rows += [(p.stem, "not run", 0.0, "") for p in paths[i - 1:]]
                        break
                    rows.append(_run_one(path, f"[{i}/{len(paths)}]", out, figures, world_size, parameters,
                                         progress, scratches))
                    write_records(out, path.stem, info)
                    if server is not None and server.poll() is not None:
                        rows[-1] = (*rows[-1][:3], _server_died(server, rows[-1][3]))
                        forkserver.stop(server)      # unsets FSDPLAB_FORKSERVER: the next kernels start directly
                        server = None
                    if rows[-1][1] == INTERRUPTED:   # Ctrl-C or SIGTERM: the lessons after it do not start
                        rows += [(p.stem, "not run", 0.0, "") for p in paths[i:]]
                        break
                return rows
    finally:
        estimates_ahead.stop(ahead)
        if not outer:
            forkserver.stop(server)
        if server_dir:
            shutil.rmtree(server_dir, ignore_errors=True)
        for scratch in scratches:   # a kernel stopped while it started may have written after its lesson
            shutil.rmtree(scratch, ignore_errors=True)
        if own_cache:
            shutil.rmtree(own_cache, ignore_errors=True)


def write_records(out: Path, lesson: str, info: dict) -> None:
    """Put `lesson`'s records (from its executed notebook in `out`) into `out`/records.json, which keeps the
    other lessons' records already there: {"lessons": {stem: [records...]}, "run_info": the machine}."""
    from .. import records

    path = out / "records.json"
    try:
        lessons = records.read_run(path)
    except ValueError:   # none yet, or not readable: this run's lessons start it afresh
        lessons = {}
    executed = out / f"{lesson}.ipynb"
    try:
        lessons[lesson] = records.read(executed)
    except ValueError:   # no executed notebook (stopped before papermill wrote one)
        lessons.pop(lesson, None)
    temp = out / ".records.json.tmp"
    temp.write_text(json.dumps({"lessons": lessons, "run_info": info}, indent=1))
    os.replace(temp, path)


def _server_died(server, detail: str) -> str:
    """The summary's detail when the fork server died under a lesson: that, not "Kernel died", is the cause."""
    import signal as signals

    code = server.returncode
    how = f"killed by {signals.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return (f"the run's fork server (pid {server.pid}) died ({how}) and took this lesson's kernel, a fork of it, "
            f"with it; the lessons after it start without it" + (f" [{detail}]" if detail else ""))


def _run_one(path, counter, out, figures, world_size, parameters, progress, made) -> tuple:
    """One lesson through papermill: (lesson, status, seconds, detail)."""
    import papermill as pm

    from . import kernels   # jupyter_client and zmq: only where lessons run

    declared = declared_parameters(path)
    params = {k: v for k, v in (parameters or {}).items() if k in declared}
    if world_size is not None and "world_size" in declared:
        params["world_size"] = world_size
    print(f"{counter} {path.stem} {params or ''}", flush=True)
    scratch = Path(owned_temp_dir(f"fsdplab-run-{path.stem[:2]}-", forkserver.short_temp_dir()))   # kernel sockets
    made.append(scratch)
    # Papermill rewrites its output after every cell: a full disk would leave a truncated notebook in place of
    # the last run's. It writes beside it, and the whole notebook replaces the old one at the end.
    running = out / f".{path.stem}.running.ipynb"
    t0 = time.perf_counter()
    status, detail = "ok", ""
    saved_tempdir = tempfile.tempdir
    try:
        with _environment(FSDPLAB_OUT=str(out), FSDPLAB_FIGURES=str(figures),
                          TMPDIR=str(scratch), TEMP=str(scratch), TMP=str(scratch)), \
                _interruptible():
            # the kernel's connection file too: a stop while the kernel starts skips its removal
            tempfile.tempdir = str(scratch)
            pm.execute_notebook(str(path), str(running), parameters=params, cwd=str(out),
                                progress_bar=progress, kernel_name="python3",
                                kernel_manager_class=kernels.UnixSocketKernelManager,
                                # The kernel's own log goes to this terminal and holds only
                                # housekeeping (the interrupt at shutdown); the
                                # cells' errors are in the executed notebook and the summary.
                                extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
                                # The last cell has run: end the kernel at once rather than wait ~1 s
                                # for its exit handlers; its watcher (fsdplab.runtime.reaper) ends any ranks.
                                shutdown_kernel="immediate")
    except pm.PapermillExecutionError as e:
        status = "FAILED"
        detail = f"cell {e.exec_count} ({e.ename}: {str(e.evalue).splitlines()[0] if e.evalue else ''})"
    except Exception as e:  # a kernel that died, a missing kernel spec, ...
        status, detail = "FAILED", f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:   # Ctrl-C, or SIGTERM (run_command turns it into one): the summary still comes
        status, detail = INTERRUPTED, "stopped while running; the executed notebook shows how far it got"
    finally:
        if status == INTERRUPTED:
            _cancel_cut_off_tasks()
            _kill_kernels()
        tempfile.tempdir = saved_tempdir
        _remove_scratch(scratch)
        if status == INTERRUPTED:
            _mark_unfinished(running)
        if status == INTERRUPTED and not running.exists():
            detail = "stopped before papermill wrote its notebook: no executed notebook"
        elif not _put_in_place(running, out / path.name):
            status = "FAILED"
            detail = (detail + "; " if detail else "") + (f"the executed notebook could not be written in full "
                                                          f"(disk full?): {out / path.name} is the previous run's")
    return path.stem, status, time.perf_counter() - t0, detail


def _cancel_cut_off_tasks(wait_s: float = 15.0) -> None:
    """The interrupt leaves papermill's coroutines (a kernel's start, a cell's reply) pending on the
    event loop jupyter keeps for this thread; a later run of that loop would resume them after the
    cleanup (a connection file written into a removed folder, a kernel started). Cancel them now, so
    that their own cleanup (the kernel stopped, its files removed) runs before the lesson's."""
    import asyncio

    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    if loop.is_running() or loop.is_closed():
        return
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        try:
            loop.run_until_complete(asyncio.wait(tasks, timeout=wait_s))
        except Exception:  # noqa: BLE001 - what a cancelled task raises is its own; the run goes on
            pass
    for task in asyncio.all_tasks(loop) | set(tasks):
        if task.done() and not task.cancelled():
            task.exception()   # retrieved: asyncio would log each as "never retrieved", a traceback


def _kill_kernels() -> None:
    """Kill the kernels this process launched that are still there: one whose start the interrupt cut
    off belongs to no kernel manager any more, and a launcher that finds the fork server gone starts
    it the ordinary way, to write into the lesson's folder after the run. (Killing a kernel's fork
    client makes the server kill its fork.)"""
    import psutil

    kernels = []
    for child in psutil.Process().children():
        try:
            if "ipykernel_launcher" in child.cmdline():
                kernels.append(child)
        except psutil.Error:
            pass
    for kernel in kernels:
        try:
            kernel.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kernels, timeout=10)


def _mark_unfinished(path: Path) -> None:
    """Papermill's notebook of an interrupted run calls every cell "completed"; mark those it never started
    "pending", and the last one it started "interrupted". That cell may have no execution count yet:
    papermill starts it before the kernel takes it up."""
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    code = [cell for cell in nb.get("cells", []) if cell.get("cell_type") == "code"]
    started = []
    for cell in code:
        meta = cell.setdefault("metadata", {}).setdefault("papermill", {})
        if meta.get("start_time") or cell.get("execution_count") is not None:
            started.append(meta)
        else:
            meta["status"] = "pending"
    if started:
        started[-1]["status"] = INTERRUPTED
    nb.setdefault("metadata", {}).setdefault("papermill", {})["interrupted"] = True
    path.write_text(json.dumps(nb, indent=1))


def _put_in_place(running: Path, final: Path) -> bool:
    """Move papermill's output to its name if it is a whole notebook; False (and removed) when it is not."""
    try:
        json.loads(running.read_text())
        os.replace(running, final)
        return True
    except (OSError, ValueError):
        running.unlink(missing_ok=True)
        return False


def print_table(rows) -> None:
    width = max([len("lesson")] + [len(r[0]) for r in rows])
    states = max([len("status")] + [len(r[1]) for r in rows])
    print(f"\n{'lesson':<{width}}  {'status':<{states}}  seconds  detail")
    for lesson, status, seconds, detail in rows:
        print(f"{lesson:<{width}}  {status:<{states}}  {seconds:7.1f}  {detail}")


INTERRUPTED = "interrupted"


@contextlib.contextmanager
def output_lock(out: Path):
    """Hold `out` for one run: two runs into one folder delete each other's checkpoints and overwrite each
    other's notebooks. A second run is refused at once, naming the first; the lock ends with its process."""
    import fcntl

    handle = open(out / ".fsdplab-run.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ValueError(f"--out {out} is in use by another fsdplab run ({holder}): wait for it to end, or "
                         f"give this run its own folder (--out runs-2).") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield
    finally:
        handle.close()

