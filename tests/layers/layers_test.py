#!/usr/bin/env python3
"""kvwire's layers point one way: a check over every #include of the tree (ctest `layers`).

Each source file belongs to one component (by folder, COMPONENTS below), and a component may
include only itself and the components RULES lists for it. From the bottom up:

  base        util, gpu; proto (the core's wire schema, generated); api (include/kvwire,
              the public headers: they include only each other)
  transport   transport/transport.h, the interface between the engine and a transport
  transports  transport/<name>/ (tcp, shm, rdma, and any folder added there): the interface and
              the base, never another transport nor the core's schema (each has its own)
  builtins    transport/builtin_transports.cc, the list of built-in transports (linked into
              libkvwire; the core reaches it through transport/transport.h's declaration)
  control     src/control, the control channel;  discovery  src/discovery (etcd)
  core        src/core, the engine: the transport interface, control, base; never a
              concrete transport
  connector   src/connector, the KV connector: the public API (and discovery), never the core
  capi        src/capi, the C ABI over the public API
  top         examples, perf, python, tests, src/connector/bench: anything

Besides, no two files of the tree include each other, directly or in a longer cycle.

  layers_test.py [--root DIR]           check; exit 1 and name every back arrow
  layers_test.py --graph [--root DIR]   print the component graph (include lines per arrow)
  layers_test.py --self-test            check the checker on a small planted tree
"""

import argparse
import collections
import os
import re
import sys
import tempfile

BASE = {"util", "gpu"}
TOP = {"examples", "perf", "python", "tests", "tools"}
# Concrete transports are found as folders of transport/; these are the ones in the tree.
KNOWN_TRANSPORTS = {"tcp", "shm", "rdma"}

# Component -> the components it may include (besides itself). A transport folder not listed
# here gets the rule of "<transport>"; every component may include nothing else.
RULES = {
    "util": set(),
    "gpu": {"util"},
    "proto": set(),
    "api": set(),
    "transport": {"api"} | BASE,
    "<transport>": {"transport", "api"} | BASE,
    "builtins": {"transport", "api", "<transport>"} | BASE,
    "control": {"proto", "api"} | BASE,
    "discovery": {"api"} | BASE,
    "core": {"transport", "control", "proto", "api"} | BASE,
    "connector": {"api", "discovery"} | BASE,
    "capi": {"api"} | BASE,
}
# Drawing order of --graph (lower rows first).
RANKS = [["util", "proto", "api"], ["gpu"], ["transport"], ["<transport>", "control", "discovery"],
         ["builtins", "core", "connector"], ["capi"], sorted(TOP)]

SOURCE_SUFFIXES = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh")
SCANNED = ("include", "proto", "src", "transport", "examples", "perf", "python", "tests")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def component(path):
    """The component of a file, from its path relative to the root; None if outside them."""
    parts = path.split("/")
    if parts[0] == "include" and len(parts) > 1 and parts[1] == "kvwire":
        return "api"
    if parts[0] == "proto":
        return "proto"
    if parts[0] == "transport":
        if len(parts) == 2:
            return "builtins" if parts[1].startswith("builtin_transports") else "transport"
        return "transport/" + parts[1]
    if parts[0] == "src" and len(parts) > 2:
        if parts[1] == "connector":
            # The C ABI: its own folder (src/capi); files still named c_api* in the connector's
            # folder count as the C ABI too.
            if parts[2].startswith("c_api"):
                return "capi"
            if parts[2] == "bench":
                return "tools"
        return parts[1] if parts[1] in RULES else "src/" + parts[1]
    if parts[0] in TOP:
        return parts[0]
    return None


def rule_name(comp):
    return "<transport>" if comp.startswith("transport/") else comp


def allowed(src, dst):
    if src == dst or rule_name(src) in TOP:
        return True
    deps = RULES.get(rule_name(src), set())  # a folder without a rule may include nothing
    return dst in deps or rule_name(dst) in deps


def source_files(root):
    for top in SCANNED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(SOURCE_SUFFIXES):
                    yield os.path.relpath(os.path.join(dirpath, name), root)


def resolve(root, including, target):
    """The tree file an include names (generated x.pb.h: its x.proto), or None if external."""
    candidates = [target, os.path.join("include", target),
                  os.path.normpath(os.path.join(os.path.dirname(including), target))]
    for c in candidates:
        if os.path.isfile(os.path.join(root, c)):
            return c
    if target.endswith(".pb.h"):
        proto = target[: -len(".pb.h")] + ".proto"
        if os.path.isfile(os.path.join(root, proto)):
            return proto
    return None


def scan(root):
    """[(including file, line, included file, include as written)] for each include of the tree."""
    out = []
    for path in source_files(root):
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for m in INCLUDE.finditer(text):
            target = resolve(root, path, m.group(1))
            if target is not None:
                out.append((path, text.count("\n", 0, m.start()) + 1, target, m.group(1)))
    return out


def file_cycles(includes):
    """Include cycles among files, each as a list of files (first == last)."""
    graph = collections.defaultdict(set)
    for src, _, dst, _ in includes:
        if src != dst:
            graph[src].add(dst)
    cycles, state = [], {}
    for start in sorted(graph):
        if start in state:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1  # on the path
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2  # done
                stack.pop()
                path.pop()
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return cycles


def analyse(root):
    includes = scan(root)
    edges = collections.defaultdict(list)  # (src comp, dst comp) -> [(file, line, target)]
    for src, line, dst, written in includes:
        a, b = component(src), component(dst)
        if a is None or b is None or a == b:
            continue
        edges[(a, b)].append((src, line, written))
    back = {e: sites for e, sites in edges.items() if not allowed(*e)}
    return edges, back, file_cycles(includes)


def print_graph(edges, back):
    comps = sorted({c for e in edges for c in e})
    rank = {}
    for i, row in enumerate(RANKS):
        for c in row:
            rank[c] = i
    comps.sort(key=lambda c: (rank.get(rule_name(c), len(RANKS)), c))
    print("component graph: A -> B (include lines); '<<< back' marks an arrow the rules forbid")
    for a in comps:
        outs = sorted((b for (x, b) in edges if x == a),
                      key=lambda b: (rank.get(rule_name(b), len(RANKS)), b))
        if not outs:
            print(f"  {a}")
        for b in outs:
            mark = "  <<< back" if (a, b) in back else ""
            print(f"  {a} -> {b} ({len(edges[(a, b)])}){mark}")
    lines = sum(len(s) for s in back.values())
    print(f"back arrows: {len(back)} ({lines} include lines)")


def check(root, graph):
    edges, back, cycles = analyse(root)
    if graph:
        print_graph(edges, back)
        print(f"file include cycles: {len(cycles)}")
    for (a, b), sites in sorted(back.items()):
        print(f"back arrow {a} -> {b}: {a} may include only "
              f"{', '.join(sorted(RULES[rule_name(a)])) or 'itself'}")
        for src, line, dst in sites:
            print(f"  {src}:{line}: includes {dst}")
    for cycle in cycles:
        print("include cycle: " + " -> ".join(cycle))
    if back or cycles:
        return 1
    if not graph:
        print(f"layers: {len(edges)} arrows between components, none back; no include cycle")
    return 0


def self_test():
    """The checker finds a planted back arrow and a planted cycle, and passes a clean tree."""
    files = {
        "src/util/log.h": "",
        "transport/transport.h": '#include "kvwire/engine.h"\n',
        "include/kvwire/engine.h": "",
        "include/kvwire/a.h": '#include "kvwire/b.h"\n',
        "include/kvwire/b.h": "",
        "transport/tcp/tcp.h": '#include "transport/transport.h"\n#include "src/util/log.h"\n',
        "transport/rdma/rdma.cc": '#include "transport/rdma/rdma.pb.h"\n',
        "transport/rdma/rdma.proto": "",
        "src/core/engine.cc": '#include "transport/transport.h"\n#include "proto/kvwire.pb.h"\n',
        "proto/kvwire.proto": "",
        "src/connector/c_api.cc": '#include "kvwire/engine.h"\n',
        "src/connector/connector.cc": '#include "kvwire/engine.h"\n',
        "tests/x_test.cc": '#include "src/core/engine.cc"\n',
    }
    planted = {
        "src/core/engine.cc": '#include "transport/tcp/tcp.h"\n',        # core -> a transport
        "transport/tcp/tcp.h": '#include "transport/rdma/rdma.pb.h"\n',  # tcp -> rdma
        "src/connector/c_api.cc": '#include "src/core/engine.cc"\n',    # capi -> core
        "include/kvwire/b.h": '#include "kvwire/a.h"\n',                 # cycle a <-> b
    }
    failures = []
    with tempfile.TemporaryDirectory() as root:
        def write(extra):
            for path, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
                with open(os.path.join(root, path), "w") as f:
                    f.write(text + extra.get(path, ""))
        write({})
        edges, back, cycles = analyse(root)
        if back or cycles or ("transport/rdma", "transport/rdma") in edges:
            failures.append(f"clean tree: back {sorted(back)}, cycles {cycles}")
        if ("core", "proto") not in edges or ("transport", "api") not in edges:
            failures.append(f"clean tree: arrows missing: {sorted(edges)}")
        write(planted)
        _, back, cycles = analyse(root)
        want = {("core", "transport/tcp"), ("transport/tcp", "transport/rdma"), ("capi", "core")}
        if set(back) != want:
            failures.append(f"planted tree: back arrows {sorted(back)}, want {sorted(want)}")
        if len(cycles) != 1 or set(cycles[0]) != {"include/kvwire/a.h", "include/kvwire/b.h"}:
            failures.append(f"planted tree: cycles {cycles}")
    for f in failures:
        print("self-test: " + f)
    return 1 if failures else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."))
    parser.add_argument("--graph", action="store_true", help="print the component graph")
    parser.add_argument("--self-test", action="store_true", help="check the checker")
    args = parser.parse_args()
    if args.self_test:
        return self_test()
    return check(os.path.abspath(args.root), args.graph)


if __name__ == "__main__":
    sys.exit(main())
