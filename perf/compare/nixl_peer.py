#!/usr/bin/env python3
"""NIXL (nixl-cu12, its UCX backend) as a `make compare` peer: host memory, two processes on
loopback. Runs in the compare virtual environment; see peer_common.py for the protocol and the
measurement loops, perf/compare/README.md for why this is fair to NIXL.

  --transport tcp   UCX_TLS=tcp (NIXL's default UCX error handling, "peer")
  --transport shm   UCX_TLS=shm,self (posix/sysv/cma) with ucx_error_handling_mode=none:
                    UCX's shared-memory transports have no peer failure handler, and NIXL's
                    default ("peer") refuses to create its backend without one.

Each side registers one buffer with the UCX backend; the initiator prepares two descriptor
lists (its blocks and the target's) once, makes one transfer request per batch from indices
into them (nixl's make_prepped_xfer, as vLLM's NixlConnector does), and reposts each request
(postXferReq) as it completes. The target runs NIXL's progress thread and sleeps; the
initiator runs none and busy-polls its requests (check_xfer_state).
"""
import argparse
import os
import sys

import peer_common as pc


def tls_env(transport):
    env = dict(os.environ)
    env["UCX_TLS"] = "tcp" if transport == "tcp" else "shm,self"
    return env


def make_agent(name, transport, progress_thread):
    from nixl_cu12 import nixl_agent, nixl_agent_config  # the venv's; imported late for errors
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    agent.create_backend(
        "UCX", {"ucx_error_handling_mode": "peer" if transport == "tcp" else "none"})
    return agent


class Backend:
    def __init__(self, agent, local, remote_name, remote_addr, remote_size, op):
        self.agent = agent
        self.local = local
        self.remote_name = remote_name
        self.remote_addr = remote_addr
        self.remote_size = remote_size
        self.op = op
        self.lists = {}

    def _dlists(self, length):
        """One prepared descriptor list per side and block length: every block of the buffer."""
        if length not in self.lists:
            n_local = self.local.size // length
            n_remote = self.remote_size // length
            loc = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(self.local.addr + i * length, length, 0)
                                    for i in range(n_local)], "DRAM")
            rem = self.agent.prep_xfer_dlist(
                self.remote_name, [(self.remote_addr + i * length, length, 0)
                                   for i in range(n_remote)], "DRAM")
            self.lists[length] = (loc, rem)
        return self.lists[length]

    def prepare(self, ops):
        lengths = {n for _, _, n in ops}
        aligned = len(lengths) == 1 and all(l % n == 0 and r % n == 0 for l, r, n in ops)
        if aligned:  # fixed-size blocks: indices into the prepared lists
            (n,) = lengths
            loc, rem = self._dlists(n)
            return self.agent.make_prepped_xfer(self.op, loc, [l // n for l, _, _ in ops],
                                                rem, [r // n for _, r, _ in ops])
        # The kv request's ranges (every length, any offset): one list per side, in order.
        loc = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(self.local.addr + l, n, 0) for l, _, n in ops], "DRAM")
        rem = self.agent.prep_xfer_dlist(
            self.remote_name, [(self.remote_addr + r, n, 0) for _, r, n in ops], "DRAM")
        idx = list(range(len(ops)))
        return self.agent.make_prepped_xfer(self.op, loc, idx, rem, idx)

    def post(self, handle):
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("nixl transfer: ERR at post")
        return handle

    def poll(self, handle):
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError("nixl transfer: ERR")
        return state == "DONE"


def main():
    ap = pc.add_options(argparse.ArgumentParser(description=__doc__))
    ap.add_argument("--transport", choices=["tcp", "shm"], default="tcp")
    args = ap.parse_args()
    os.environ.update(tls_env(args.transport))
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines would bury the result
    try:
        buf = pc.Buffer(pc.buffer_bytes(args))
        if args.role == "target":
            agent = make_agent("kvwire-compare-target", args.transport, progress_thread=True)
            agent.register_memory([(buf.addr, buf.size, 0, "")], "DRAM")
            pc.serve({"meta": agent.get_agent_metadata().hex(), "addr": buf.addr,
                      "size": buf.size})
            os._exit(0)  # NIXL 1.5.1's teardown after a peer left can crash; nothing to flush
        agent = make_agent("kvwire-compare-initiator", args.transport, progress_thread=False)
        agent.register_memory([(buf.addr, buf.size, 0, "")], "DRAM")
        target, info = pc.start_target([sys.executable, __file__, "target"] + sys.argv[2:])
    except Exception as e:  # noqa: BLE001 - the reason is the row
        pc.fail(f"nixl setup: {type(e).__name__}: {e}")
    try:
        name = agent.add_remote_agent(bytes.fromhex(info["meta"]))
        backend = Backend(agent, buf, name, info["addr"], info["size"], args.op)
        result = pc.measure(backend, args)
        result["peer"] = f"nixl ucx {args.transport}"
        print(pc.json.dumps(result), flush=True)
    except Exception as e:  # noqa: BLE001
        pc.fail(f"nixl {args.mode}: {type(e).__name__}: {e}")
    finally:
        pc.stop_target(target)
    os._exit(0)


if __name__ == "__main__":
    main()
