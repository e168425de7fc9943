"""Containment as guarantees, proved on real containers through a real MCP client: the
code cannot reach the bridge's channel, forged frames stop at the supervisor, a timeout
ends everything the code started, background work cannot act or speak after its call,
and only the documented paths are writable. The check_* bodies run again under gVisor
(tests/test_gvisor.py)."""

from __future__ import annotations

import re
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from tests.conftest import (
    IGNORES_INTERRUPTS,
    Engine,
    bridge_client,
    bridge_env,
    claude_desktop_home,
    proxy_env,
    run_cell,
    stub_entry,
)

pytestmark = pytest.mark.anyio

# How hostile code reaches its own frame pipe to the supervisor (not the bridge's channel).
EXECUTOR = "[o for o in __import__('gc').get_objects() if type(o).__name__ == 'ExecutorProcess'][0]"
# Live processes in the container other than the supervisor (PID 1) and the caller.
PROCESSES = """
import os
def processes():
    found = []
    for pid in os.listdir('/proc'):
        if pid.isdigit() and int(pid) not in (1, os.getpid()):
            try:
                stat = open('/proc/%s/stat' % pid).read()
            except OSError:
                continue
            found.append((int(pid), stat[stat.rfind(')') + 2]))
    return found
"""


run = run_cell


# --- the channel to the bridge is out of reach ----------------------------------------------


async def test_code_cannot_open_the_supervisors_descriptors(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(
            client,
            """
            import os
            outcomes = {}
            for path in ("/proc/1/fd/0", "/proc/1/fd/1", "/proc/1/fd/2"):
                try:
                    open(path, "wb").close()
                    outcomes[path] = "opened"
                except OSError as exc:
                    outcomes[path] = type(exc).__name__
            try:
                os.listdir("/proc/1/fd")
                outcomes["list"] = "listed"
            except OSError as exc:
                outcomes["list"] = type(exc).__name__
            outcomes
            """,
        )
        outcomes = eval(answer["value"])
        assert set(outcomes.values()) == {"PermissionError"}, outcomes


async def test_no_descriptor_of_the_code_reaches_the_bridge(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(
            client,
            f"""
            import json, os
            running = {EXECUTOR}.running_id
            # A stream frame is something only the supervisor sends: if one of these arrived
            # as a frame, this call's stdout would carry the bare marker.
            marker = "FORGED" + "-DIRECT"
            frame = json.dumps({{"type": "stream", "id": running, "name": "stdout", "text": marker}})
            tried = []
            for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")):
                if fd in (1, 2):
                    continue  # the output pipes: text written there is output, by design
                try:
                    os.write(fd, (frame + "\\n").encode())
                    tried.append(fd)
                except OSError:
                    pass
            tried
            """,
        )
        assert answer["status"] == "ok", answer
        # Text written to the output pipes (the private copies of fd 1/2) is output; a frame
        # that reached the bridge would show the bare marker, without the JSON around it.
        assert "FORGED-DIRECT" not in answer["stdout"].replace('"text": "FORGED-DIRECT"', ""), answer
        assert eval(answer["value"]), "the code should at least reach its own pipe to the supervisor"
        assert (await run(client, "6 * 7"))["value"] == "42"


async def test_forged_frames_cannot_make_a_second_result_or_carry_bad_fields(
    engine: Engine, state_dir: Path
) -> None:
    await check_forged_frames_cannot_make_a_second_result_or_carry_bad_fields(bridge_env(engine, state_dir))


async def check_forged_frames_cannot_make_a_second_result_or_carry_bad_fields(
    env: dict[str, str],
) -> None:
    async with bridge_client(env) as client:
        forged = await run(
            client,
            f"""
            executor = {EXECUTOR}
            channel, running = executor.channel, executor.running_id
            channel.send({{"type": "result", "id": "not-this-call", "status": "ok", "value": "WRONG-ID"}})
            channel.send({{"type": "result", "id": running, "status": "ok", "value": 12345}})
            channel.send({{"type": "result", "id": running, "status": "bogus", "value": "BAD-STATUS"}})
            channel.send({{"type": "stream", "id": running, "name": "stdout", "text": "FORGED-STREAM"}})
            channel.send({{"type": "result", "id": running, "status": "ok", "value": "'FORGED'"}})
            channel.send({{"type": "result", "id": running, "status": "ok", "value": "'SECOND'"}})
            import time
            time.sleep(0.5)
            "real"
            """,
        )
        # The one well-formed result for this call ends it (code can end its own call early,
        # like any REPL); nothing else gets through.
        assert forged["value"] == "'FORGED'", forged
        assert "FORGED-STREAM" not in forged["stdout"]
        after = await run(client, "'next'")
        assert after["value"] == "'next'", after
        assert any("rejected" in notice for notice in after["notices"]), after["notices"]
        assert (await run(client, "6 * 7"))["value"] == "42"


# --- timeouts end everything the code started -----------------------------------------------


async def test_a_fork_bomb_times_out_and_leaves_no_process_behind(engine: Engine, state_dir: Path) -> None:
    await check_a_fork_bomb_times_out_and_leaves_no_process_behind(bridge_env(engine, state_dir))


async def check_a_fork_bomb_times_out_and_leaves_no_process_behind(
    env: dict[str, str],
) -> None:
    async with bridge_client(env) as client:
        await run(client, "kept = 'yes'")
        started = time.monotonic()
        bomb = await run(
            client,
            """
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
            """,
            timeout=4,
        )
        elapsed = time.monotonic() - started
        assert bomb["status"] == "timeout", bomb
        # The timeout, the grace period (the bomb's interrupt is lost: it lands in os.fork's
        # at-fork hooks, which swallow exceptions), then the kill, a fresh executor and the
        # round trip: measured 7.4-8.1 s on both runtimes, 9.1 s under gVisor on a loaded CI
        # machine. The bound is for a kill that never comes (the call would wait out the
        # client's 60 s), not a speed target: speed belongs to benchmarks/.
        assert elapsed < 4 + 3 + 15, elapsed
        after = await run(
            client,
            PROCESSES
            + textwrap.dedent(
                """
                import subprocess, time
                deadline = time.monotonic() + 5
                while processes() and time.monotonic() < deadline:
                    time.sleep(0.05)  # children killed a moment ago may still be being reaped
                (subprocess.run(["true"]).returncode, processes())
                """
            ),
        )
        assert after["value"] == "(0, [])", after
        if bomb["state_kept"]:
            assert (await run(client, "kept"))["value"] == "'yes'"


async def test_children_killed_at_a_timeout_do_not_linger_as_zombies(engine: Engine, state_dir: Path) -> None:
    await check_children_killed_at_a_timeout_do_not_linger_as_zombies(bridge_env(engine, state_dir))


async def check_children_killed_at_a_timeout_do_not_linger_as_zombies(
    env: dict[str, str],
) -> None:
    async with bridge_client(env) as client:
        await run(client, PROCESSES)
        started = await run(
            client,
            "import subprocess, time\nchild = subprocess.Popen(['sleep', '600'])\ntime.sleep(60)",
            timeout=2,
        )
        assert started["status"] == "timeout" and started["state_kept"], started
        after = await run(client, "processes()")
        assert after["value"] == "[]", after


async def test_background_shells_leave_no_zombies(engine: Engine, state_dir: Path) -> None:
    await check_background_shells_leave_no_zombies(bridge_env(engine, state_dir))


async def check_background_shells_leave_no_zombies(env: dict[str, str]) -> None:
    async with bridge_client(env) as client:
        answer = await run(
            client,
            PROCESSES
            + textwrap.dedent(
                """
                import subprocess, time
                for _ in range(500):
                    subprocess.run(["sh", "-c", "sleep 0.01 &"], check=True)
                deadline = time.monotonic() + 5
                while processes() and time.monotonic() < deadline:
                    time.sleep(0.05)
                processes()
                """
            ),
            timeout=120,
        )
        assert answer["value"] == "[]", answer


async def test_a_hard_kill_starts_a_fresh_process_and_keeps_files(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run(client, "open('/tmp/kept.txt', 'w').write('file kept')\nvariable = 1")
        stubborn = await run(client, IGNORES_INTERRUPTS, timeout=2)
        assert stubborn["status"] == "timeout" and stubborn["state_kept"] is False, stubborn
        assert "fresh Python process" in stubborn["text"], stubborn
        ready = re.search(r"a fresh Python process was ready (\d+) ms later", stubborn["text"])
        # Measured 50-60 ms on an idle machine; the bound only tells "ready in the same container"
        # from a container restart on a loaded one (CI shares its cores).
        assert ready is not None and int(ready.group(1)) < 3000, stubborn["text"]
        after = await run(client, "open('/tmp/kept.txt').read()")
        assert after["value"] == "'file kept'", after
        lost = await run(client, "variable")
        assert "NameError" in lost["text"], lost


# --- background work is explicit -------------------------------------------------------------


async def test_a_thread_cannot_call_a_tool_after_its_call_returned(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "reached-the-server"
    env = proxy_env(engine, state_dir, claude_desktop_home(tmp_path, {"stub": stub_entry()}))
    async with bridge_client(env) as client:
        await run(client, "mcp_stub.pair(a=1)")  # the server is up
        started = await run(
            client,
            f"""
            import threading, time
            from mcp import runtime
            outcome = []
            def later():
                time.sleep(1)
                try:
                    mcp_stub.slow_then_mark(seconds=0, path={str(marker)!r})
                    outcome.append("called")
                except runtime.MCPError as exc:
                    outcome.append(str(exc))
            threading.Thread(target=later, daemon=True).start()
            "started"
            """,
        )
        assert started["value"] == "'started'"
        await anyio.sleep(2)
        answer = await run(client, "outcome")
        assert "refused: the run_python call that started this thread" in answer["value"], answer
        assert not marker.exists()


async def test_a_thread_of_an_earlier_call_cannot_call_a_tool_during_a_later_one(
    engine: Engine, state_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "reached-the-server"
    env = proxy_env(engine, state_dir, claude_desktop_home(tmp_path, {"stub": stub_entry()}))
    async with bridge_client(env) as client:
        started = await run(
            client,
            f"""
            import concurrent.futures, threading
            from mcp import runtime
            go, outcome = threading.Event(), []
            pool = concurrent.futures.ThreadPoolExecutor(1)
            pool.submit(mcp_stub.pair, a=1).result()  # the pool's thread starts in this call
            def later():
                go.wait()
                try:
                    mcp_stub.slow_then_mark(seconds=0, path={str(marker)!r})
                    outcome.append("called")
                except runtime.MCPError as exc:
                    outcome.append(str(exc))
            leftover = threading.Thread(target=later, daemon=True)
            leftover.start()
            "started"
            """,
        )
        assert started["value"] == "'started'", started
        # The leftover thread asks while the next call runs (the supervisor is busy).
        answer = await run(
            client,
            """
            go.set()
            leftover.join(10)
            mine = []  # this call's own thread and pool job may call tools
            own = threading.Thread(target=lambda: mine.append(mcp_stub.pair(a=2)["sum"]))
            own.start()
            own.join(10)
            outcome, mine, pool.submit(mcp_stub.pair, a=3).result()["sum"]
            """,
        )
        refused, mine, pooled = eval(answer["value"])
        assert len(refused) == 1 and "refused: the run_python call that started this thread" in refused[0], (
            answer
        )
        assert (mine, pooled) == ([4], 5), answer
        assert not marker.exists()


async def test_background_output_is_dropped_and_counted_not_mixed_into_a_later_call(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        await run(
            client,
            """
            import threading, time
            def chatter():
                for _ in range(50):
                    print("BACKGROUND")
                    time.sleep(0.01)
            threading.Thread(target=chatter, daemon=True).start()
            """,
        )
        await anyio.sleep(1.5)
        answer = await run(client, "print('mine')")
        assert answer["stdout"] == "mine\n", answer
        assert any("while no call was running" in notice for notice in answer["notices"]), answer


# --- exactly the documented writable paths ------------------------------------------------------


# Every read-write mount of the container (so a new one is probed without naming it here)
# and the usual places, each tried with a new file: the list of those that took it.
WRITABLE_PATHS = """
import os
read_write = {fields[4] for fields in (line.split() for line in open("/proc/self/mountinfo"))
              if "rw" in fields[5].split(",")}
writable = []
for path in sorted(read_write | {"/", "/etc", "/usr", "/var/tmp", "/run", "/ipc", "/root", "/home"}):
    probe = os.path.join(path, "probe-%d" % os.getpid())
    try:
        with open(probe, "w"):
            pass
    except OSError:
        continue
    writable.append(path)
    os.remove(probe)
"""
DOCUMENTED_WRITABLE = ["/dev/shm", "/tmp", "/workspace"]


async def test_only_the_documented_paths_are_writable(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(
            client,
            WRITABLE_PATHS
            + textwrap.dedent(
                """
                mounts = {line.split()[1]: line.split()[3] for line in open("/proc/mounts")}
                (writable, {path: mounts.get(path, "") for path in ("/tmp", "/workspace", "/dev/shm")},
                 sorted(read_write))
                """
            ),
        )
        writable, options, read_write = eval(answer["value"])
        assert writable == DOCUMENTED_WRITABLE, (writable, read_write)
        assert set(DOCUMENTED_WRITABLE) < set(read_write), read_write  # the probe list is derived
        for path, flags in options.items():
            assert {"nosuid", "nodev", "noexec"} <= set(flags.split(",")), (path, flags)
        # Sizes follow the memory limit (512m by default): 1/4, 1/4 and 1/8 of it.
        assert "size=131072k" in options["/tmp"] and "size=131072k" in options["/workspace"], options
        assert "size=65536k" in options["/dev/shm"], options


async def test_filling_tmp_is_enospc_and_the_session_survives(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(
            client,
            """
            import errno
            kept = "state"
            chunk = b"x" * (1 << 20)
            written = 0
            try:
                with open("/tmp/fill", "wb") as handle:
                    while True:
                        handle.write(chunk)
                        written += 1
            except OSError as exc:
                failure = errno.errorcode[exc.errno]
            (failure, written)
            """,
            timeout=120,
        )
        failure, written = eval(answer["value"])
        assert failure == "ENOSPC" and written <= 128, answer
        after = await run(client, "import os; os.remove('/tmp/fill'); kept")
        assert after["value"] == "'state'", after


# --- limits -------------------------------------------------------------------------------------


async def test_the_limits_hold_inside_the_sandbox(engine: Engine, state_dir: Path) -> None:
    env = bridge_env(
        engine, state_dir, MCP_BRIDGE_MEMORY="256m", MCP_BRIDGE_PIDS="100", MCP_BRIDGE_CPUS="1.5"
    )
    async with bridge_client(env) as client:
        answer = await run(
            client,
            """
            import resource
            def cgroup(*names):  # cgroup v1 (one folder per controller) or v2 (one folder)
                for name in names:
                    for folder in ("/sys/fs/cgroup/", "/sys/fs/cgroup/" + name.split(".")[0] + "/"):
                        try:
                            return open(folder + name).read().split()
                        except OSError:
                            pass
            cpu = cgroup("cpu.max") or cgroup("cpu.cfs_quota_us") + cgroup("cpu.cfs_period_us")
            {"nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
             "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
             "pids": cgroup("pids.max"),
             "memory": cgroup("memory.max", "memory.limit_in_bytes"),
             "cpus": int(cpu[0]) / int(cpu[1])}
            """,
        )
        assert answer["json"] == {
            "nofile": [1024, 1024],
            "nproc": [512, 512],
            "pids": ["100"],
            "memory": [str(256 << 20)],
            "cpus": 1.5,
        }, answer


# --- seccomp ------------------------------------------------------------------------------------


async def test_vsock_packet_sockets_keyrings_and_namespaces_are_refused_with_eperm(
    engine: Engine, state_dir: Path
) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(
            client,
            """
            import ctypes, errno, socket
            outcomes = {}
            families = (("AF_VSOCK", 40, socket.SOCK_STREAM), ("AF_PACKET", 17, socket.SOCK_RAW),
                        ("AF_UNIX", 1, socket.SOCK_STREAM), ("AF_INET", 2, socket.SOCK_STREAM))
            for name, family, kind in families:
                try:
                    socket.socket(family, kind).close()
                    outcomes[name] = "allowed"
                except OSError as exc:
                    outcomes[name] = errno.errorcode[exc.errno]
            libc = ctypes.CDLL(None, use_errno=True)
            def outcome(returned):
                return "allowed" if returned >= 0 else errno.errorcode[ctypes.get_errno()]
            arch = ("x86_64", "aarch64").index(__import__("platform").machine())
            # (x86_64 number, aarch64 number, arguments the kernel itself would answer with
            # another errno or success, so an EPERM can only be the profile's: no keyring
            # id 0, no type string, an unknown bpf command, a user-mode-only userfaultfd,
            # invalid perf_event_open flags)
            calls = {
                "keyctl": (250, 219, (0, 0, 0)),
                "add_key": (248, 217, (None, None, None, 0, 0)),
                "request_key": (249, 218, (None, None, None, 0)),
                "bpf": (321, 280, (9999, None, 0)),
                "userfaultfd": (323, 282, (1,)),
                "perf_event_open": (298, 241, (None, 0, -1, -1, -1)),
            }
            for name, (*numbers, args) in calls.items():
                outcomes[name] = outcome(libc.syscall(numbers[arch], *args))
            outcomes["unshare(CLONE_NEWUSER)"] = outcome(libc.unshare(0x10000000))
            outcomes
            """,
        )
        outcomes = eval(answer["value"])
        assert outcomes == {
            "AF_VSOCK": "EPERM",
            "AF_PACKET": "EPERM",
            "AF_UNIX": "allowed",
            "AF_INET": "allowed",
            "keyctl": "EPERM",
            "add_key": "EPERM",
            "request_key": "EPERM",
            "bpf": "EPERM",
            "userfaultfd": "EPERM",
            "perf_event_open": "EPERM",
            "unshare(CLONE_NEWUSER)": "EPERM",
        }, outcomes


# --- what the model and the client see -----------------------------------------------------------


async def test_terminal_escapes_never_reach_the_client(engine: Engine, state_dir: Path) -> None:
    async with bridge_client(bridge_env(engine, state_dir)) as client:
        answer = await run(client, r"print('\x1b[31mred\x1b[0m \x1b]0;title\x07 done\x00')")
        assert answer["stdout"] == "red  done\n", answer
        assert "\x1b" not in answer["text"] and "\x00" not in answer["text"]


def test_the_kernel_file_is_what_runs_in_the_sandbox() -> None:
    # The supervisor starts the executor from its own file: both must be the shipped kernel.
    import mcp_sandbox_kernel

    assert Path(mcp_sandbox_kernel.__file__).name == "mcp_sandbox_kernel.py"
    assert sys.version_info >= (3, 9)
