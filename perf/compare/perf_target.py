"""The listening port a kvwire-perf target prints ("waiting on port N"), read from its output.

Shared by compare.py and perf/before_after.py, which both start a target with `-p 0` and then
point an initiator at the port it chose.
"""
import re


def wait_for_port(target, tail_chars=600):
    """Reads `target.stdout` up to the port line and returns the port (a string); raises
    RuntimeError with the end of what the target printed when it exits without one."""
    seen = []
    for line in target.stdout:
        seen.append(line)
        m = re.search(r"waiting on port (\d+)", line)
        if m:
            return m.group(1)
    raise RuntimeError("kvwire-perf target: " + "".join(seen)[-tail_chars:])
