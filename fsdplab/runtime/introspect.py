"""What each rank is doing right now: the collective it waits in or finished last, and where in user code.

Each rank runs a small answering thread (started by fsdplab.runtime.on_rank.setup). The kernel writes a request to
the rank's ask file (a named pipe), or, for a rank on another machine, sends it over TCP with the
cluster's token (no shared filesystem); the thread answers with a snapshot: the Python frames of the rank's
main thread, the last collectives from torch's flight recorders (TORCH_FR_BUFFER_SIZE; they record op,
sequence number, group, shapes and dtypes: one for gloo, one for nccl), what call is running, and memory in use.
A thread can answer while the main thread is blocked inside a collective: the wait runs in C++ with
the GIL released.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import sys
import threading
import time

# Collectives the flight recorder keeps per rank; set on the ranks before torch creates a group.
FR_ENTRIES = 32
FR_ENV = {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES), "TORCH_INCLUDE_STACK_TRACE": "0"}

# A request that asks for the flight recorder's full dump instead of a snapshot.
DUMP_REQUEST = "frdump-"

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


# --- on the rank --------------------------------------------------------------------------------
_RANK_STATE: dict = {}   # fsdplab.runtime.on_rank's per-rank state, handed over by start_answering (no import cycle)


def start_answering(ask_file, rank_state: dict):
    """Start the thread that answers the kernel (once per rank process). `rank_state` is fsdplab.runtime.on_rank's
    live state dict: what the rank is running ("now") and its world size.

    `ask_file`: a path, for a kernel on this machine (a named pipe in the cluster's scratch folder); or
    (address, token), for a kernel on another machine: the thread listens on TCP at `address` and answers
    requests that carry `token` (no shared filesystem needed). Returns the TCP port, or None."""
    global _RANK_STATE
    _RANK_STATE = rank_state
    if isinstance(ask_file, tuple):
        address, token = ask_file
        server = socket.create_server((address, 0))
        threading.Thread(target=_answer_tcp, args=(server, token), daemon=True, name="fsdplab-answer").start()
        return server.getsockname()[1]
    if not os.path.exists(ask_file):
        os.mkfifo(ask_file)
    threading.Thread(target=_answer_loop, args=(ask_file,), daemon=True, name="fsdplab-answer").start()
    return None


def _answer(request: str) -> dict:
    try:
        answer = flight_recorder_dump() if request.startswith(DUMP_REQUEST) else snapshot()
    except Exception as exc:  # noqa: BLE001 - an answer that says why beats no answer
        answer = {"error": repr(exc)}
    answer["request"] = request
    return answer


def _answer_tcp(server, token: str) -> None:
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                conn.settimeout(2.0)
                line = conn.makefile("rb").readline().decode(errors="replace").split()
                # An empty connection is the kernel checking that this rank is alive: nothing to answer.
                if len(line) != 2 or not hmac.compare_digest(line[0], token):
                    continue
                if line[1].startswith("signal-"):  # the kernel was interrupted: SIGINT this rank
                    os.kill(os.getpid(), int(line[1].split("-")[1]))
                    conn.sendall(json.dumps({"request": line[1]}).encode())
                else:
                    conn.sendall(json.dumps(_answer(line[1])).encode())
            except OSError:
                continue


def _answer_loop(ask_file: str) -> None:
    while True:
        try:
            with open(ask_file, "rb") as pipe:  # blocks until the kernel opens it to write
                request = pipe.read().decode(errors="replace").strip()
        except OSError:
            return  # the scratch folder is gone: the cluster is stopping
        if not request:
            continue
        answer = _answer(request)
        tmp = f"{ask_file}.{request}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(answer, f)
            os.replace(tmp, f"{ask_file}.json")
        except OSError:
            return


def snapshot() -> dict:
    """This rank's state: main-thread frames, recent collectives, running call, memory."""
    import traceback

    main = threading.main_thread().ident
    frame = sys._current_frames().get(main)
    frames = [(f.filename, f.lineno, f.name, f.line or "") for f in traceback.extract_stack(frame)] if frame else []
    # Only what runs below the kernel's call (fsdplab.runtime.on_rank.call / run_source) is the user's; an idle
    # rank shows none.
    entries = [i for i, f in enumerate(frames) if f[0].endswith(os.path.join("fsdplab", "runtime", "on_rank.py"))
               and f[2] in ("call", "run_source")]
    frames = frames[entries[-1] + 1:] if entries else []
    now = _RANK_STATE.get("now")
    return {"frames": frames, "collectives": _recent_collectives(), "running": now[0] if now else None,
            "running_s": time.time() - now[1] if now else None, "pid": os.getpid(), **_memory()}


# torch keeps two flight recorders: the generic one (gloo, CPU tensors) and ProcessGroupNCCL's own, which records
# every NCCL collective and exists only in a CUDA build. An nccl cluster's group runs collectives on both (gloo
# for CPU tensors, NCCL for CUDA ones), so a rank's record is the two merged. Pickled dumps (what torch's
# analyzer reads) by name, then JSON ones.
_PICKLED_RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")
_JSON_RECORDERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
# The pickled dumps' arguments: collectives, no C++ stack traces (the ranks record none, TORCH_INCLUDE_STACK_TRACE=0,
# yet the first dump that includes them spent 5-8 s on setting up symbolization, longer than the kernel waits),
# every entry, not only active ones.
_PICKLED_ARGS = (True, False, False)


def _recorder_dumps(names: tuple, load, args: tuple = ()) -> list:
    """Each flight recorder's dump that this torch has and that answers, read with `load`."""
    try:
        from torch._C import _distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - torch without distributed
        return []
    dumps = []
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            try:
                raw = dump(*args)
            except TypeError:   # a torch whose dump takes other arguments: its defaults
                raw = dump()
            dumps.append(load(raw))
        except Exception:  # noqa: BLE001 - a recorder that cannot dump (no group of its kind yet) adds nothing
            continue
    return dumps


def merged_dump(dumps: list) -> dict:
    """One dump from several recorders' dumps: entries of all, in the order they were created; the groups of all;
    the rest (version, nccl_version, ...) from the first dump that has it."""
    merged = {}
    for dump in dumps:
        for key, value in dump.items():
            if key == "entries":
                merged.setdefault("entries", []).extend(value or [])
            elif isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**value, **merged[key]}
            else:
                merged.setdefault(key, value)
    if len(dumps) > 1:
        merged["entries"] = sorted(merged.get("entries") or [], key=lambda e: e.get("time_created_ns") or 0)
    return merged


def flight_recorder_dump() -> dict:
    """This rank's flight recorders, merged, as torch dumps them (the pickle that torch's analyzer, `torchfrtrace`,
    reads), base64-encoded for the answer's JSON."""
    import base64
    import pickle

    dumps = _recorder_dumps(_PICKLED_RECORDERS, pickle.loads, _PICKLED_ARGS)
    if not dumps:
        raise RuntimeError("this torch has no flight recorder to dump")
    return {"fr_dump": base64.b64encode(pickle.dumps(merged_dump(dumps))).decode()}


def _memory() -> dict:
    import psutil

    out = {"rss": psutil.Process().memory_info().rss}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # This thread never set a device, so its current one is GPU 0: name the rank's own.
        device = _RANK_STATE.get("device") or ""
        device = device if device.startswith("cuda") else None
        out.update(cuda_allocated=torch.cuda.memory_allocated(device),
                   cuda_reserved=torch.cuda.memory_reserved(device))
    return out


def _recent_collectives() -> list:
    """The flight recorders' last entries, trimmed to what the explanation needs (empty if unavailable)."""
    dumps = _recorder_dumps(_JSON_RECORDERS, json.loads)
    if not dumps:  # an older torch, or no recorder: fall back to stacks alone
        return []
    dump = merged_dump(dumps)
    groups = {}
    for key, config in (dump.get("pg_config") or {}).items():
        ranks = config.get("ranks", "[]")
        try:
            ranks = json.loads(ranks) if isinstance(ranks, str) else list(ranks)
        except ValueError:
            ranks = []
        groups[key] = {"desc": config.get("desc", key), "size": len(ranks)}
    out = []
    for entry in (dump.get("entries") or [])[-4:]:
        pg = list(entry.get("process_group") or ["", ""]) + [""]
        group = groups.get(str(pg[0])) or {"desc": pg[1], "size": None}
        if pg[1] == "default_pg":  # recorded under an empty name by some torch versions
            group = {"desc": pg[1], "size": _RANK_STATE.get("world_size")}
        out.append({"op": str(entry.get("profiling_name", "?")).split(":")[-1],
                    "seq": entry.get("collective_seq_id") or entry.get("p2p_seq_id"),
                    "group": group["desc"], "group_size": group["size"],
                    "sizes": entry.get("input_sizes") or [], "dtypes": entry.get("input_dtypes") or [],
                    "done": bool(entry.get("retired")) or entry.get("state") == "completed"})
    return out


# --- in the kernel ------------------------------------------------------------------------------
def ask(ask_files: dict, wait_s: float = 1.0, request: str | None = None) -> dict:
    """rank -> snapshot, from each rank's answering thread; a rank that does not answer in time is left out.

    `ask_files`: rank -> its ask pipe's path, or (address, port, token) for a rank that answers on TCP."""
    request = request or f"{os.getpid()}-{time.monotonic_ns()}"
    asked, answers = {}, {}
    remote = {r: target for r, target in ask_files.items() if isinstance(target, tuple)}
    threads = [threading.Thread(target=_ask_tcp, args=(target, request, wait_s, answers, r), daemon=True)
               for r, target in remote.items()]
    for t in threads:
        t.start()
    for rank, path in ask_files.items():
        if rank not in remote and _write_request(path, request):
            asked[rank] = path
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        for rank, path in list(asked.items()):
            try:
                with open(f"{path}.json") as f:
                    answer = json.load(f)
            except (OSError, ValueError):
                continue
            if answer.get("request") == request:
                answers[rank] = answer
                del asked[rank]
        time.sleep(0.01)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return dict(answers)


def _ask_tcp(target: tuple, request: str, wait_s: float, answers: dict, rank: int) -> None:
    address, port, token = target
    try:
        with socket.create_connection((address, port), timeout=wait_s) as conn:
            conn.settimeout(wait_s)
            conn.sendall(f"{token} {request}\n".encode())
            data = b"".join(iter(lambda: conn.recv(65536), b""))
        answer = json.loads(data)
    except (OSError, ValueError):
        return
    if answer.get("request") == request:
        answers[rank] = answer


def reachable(address: str, port: int, timeout: float = 0.5) -> bool | None:
    """Whether a rank's answering port takes a connection: False when refused (the process is gone, its
    node is up), None when unknown (no answer in time: a busy or unreachable node)."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _write_request(path: str, request: str) -> bool:
    # Non-blocking: a rank whose thread is not listening (dead, or busy between requests) must not
    # block the kernel. The thread reopens the pipe at once, so a few short retries cover the gap.
    for _ in range(20):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.005)
            continue
        try:
            os.write(fd, request.encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


def tensors(sizes: list, dtypes: list) -> str:
    """'1 float32', '4x8 bfloat16', '2 tensors: 4x8 float32, ...' from flight-recorder fields."""
    described = []
    for size, dtype in zip(sizes, dtypes):
        shape = "x".join(map(str, size)) if size else "scalar"
        described.append(f"{shape} {_DTYPES.get(dtype, dtype.lower())}")
    if not described:
        return "no tensors"
    if len(described) == 1:
        return described[0]
    return f"{len(described)} tensors: {described[0]}" + (", ..." if len(described) > 1 else "")


def _collective(entry: dict) -> str:
    group = f"group of {entry['group_size']}" if entry.get("group_size") else f"group {entry.get('group')!r}"
    return f"{entry['op']} #{entry['seq']} ({group}, {tensors(entry['sizes'], entry['dtypes'])})"


def in_collective(state: dict) -> bool:
    """Whether the rank's main thread is blocked in a collective (an unfinished recorded op, or a
    torch.distributed frame on top of its stack)."""
    frames = state.get("frames") or []
    top = frames[-1][0].replace("\\", "/") if frames else ""
    waiting = any(not e["done"] for e in state.get("collectives") or [])
    return "torch/distributed/" in top or (waiting and state.get("running") is not None)


def latest(state: dict | None) -> dict | None:
    """The collective a rank waits in, else the last one it finished: {op, seq, group_size, done, ...}."""
    collectives = (state or {}).get("collectives") or []
    waiting = [e for e in collectives if not e["done"]]
    return (waiting or collectives or [None])[-1]


def explain(rank: int, state: dict | None) -> str:
    """One line: 'rank 0 waits in all_reduce #41 (group of 2, 1 float32) at Cell In[12], line 1', or
    'rank 1 finished all_reduce #40 (group of 2, 1 float32), now idle'."""
    from .tracebacks import innermost_user_location

    if not state:
        return f"rank {rank} did not answer (busy in code that holds the GIL, or gone)"
    if "error" in state:
        return f"rank {rank}: no state ({state['error']})"
    collectives = state.get("collectives") or []
    waiting = [e for e in collectives if not e["done"]]
    finished = [e for e in collectives if e["done"]]
    where = innermost_user_location([tuple(f) for f in state.get("frames") or []])
    at = f" at {where}" if where else ""
    if waiting and in_collective(state):
        return f"rank {rank} waits in {_collective(waiting[-1])}{at}"
    last = f"finished {_collective(finished[-1])}" if finished else "has run no collective yet"
    if state.get("running") is None:
        return f"rank {rank} {last}, now idle"
    if in_collective(state):
        return f"rank {rank} waits in a collective{at} (no record of it; {last})"
    return f"rank {rank} {last}, now running{at}"
