#!/usr/bin/env python3
"""The layering rule of server/ (server/LAYERS, server/README.md): every room includes only its own
headers and those of the rooms below it, and its CMake libraries link only libraries of its own
room and below.

  check_layers.py [ROOT]        checks the tree at ROOT (default: the repository); exit 1 with one
                                line per broken rule: FILE:LINE: what it includes and why not
  check_layers.py --self-test   plants an upward include (plain, and relative with ../), an
                                upward link, a file outside every room and a private header
                                reached through another header in a copy of the rules' shape and
                                shows that each is reported; then checks the tree

A `visible ROOMS HEADER...` line of server/LAYERS makes headers private (Bazel's visibility): only
their own room and the ROOMS (comma-separated) may reach them, directly or through any chain of
included headers, so a room above them compiles without them.

Includes are resolved as the compiler does for "..." includes: against the including file's
directory first, then the repository root (the one include directory of every target), so a
relative `#include "../jobs/job.h"` counts as the file it names. Angle-bracket includes are
system or third-party headers and are not checked.
"""
import os
import re
import shutil
import sys
import tempfile

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
LINK = re.compile(r"target_link_libraries\s*\(\s*([A-Za-z0-9_]+)([^)]*)\)", re.S)
SOURCES = (".h", ".cc", ".cu", ".cpp", ".hpp", ".inc")


def read_rules(root):
    """[(room, path under server/, [targets])], top first."""
    return read_layers(root)[0]


def read_layers(root):
    """The rooms (read_rules) and the visibility of private headers: {path under server/: set of
    the rooms that may reach it besides its own}."""
    rules, visible = [], {}
    with open(os.path.join(root, "server", "LAYERS")) as f:
        for line in f:
            line = line.split("#", 1)[0].split()
            if not line:
                continue
            if line[0] == "visible":  # visible ROOM[,ROOM...] HEADER...
                for header in line[2:]:
                    visible[header] = set(line[1].split(","))
            else:
                rules.append((line[0], line[1], line[2:]))
    if not rules:
        raise SystemExit("server/LAYERS names no room")
    return rules, visible


def room_of(rel, rules):
    """The room of a path relative to server/ (None: in no room)."""
    for i, (room, where, _) in enumerate(rules):
        if where.endswith("/") and rel.startswith(where) or rel == where:
            return i
    return None


def check_includes(root, rules):
    errors = []
    server = os.path.join(root, "server")
    for dirpath, _, files in os.walk(server):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, server)
            if not name.endswith(SOURCES):
                continue
            mine = room_of(rel, rules)
            if mine is None:
                errors.append(f"server/{rel}:1: in no room of server/LAYERS")
                continue
            with open(path, errors="replace") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.match(line)
                    if not m:
                        continue
                    target = resolve(root, dirpath, m.group(1))
                    if target is None:
                        continue  # outside the repository's server/ (common/, proto/, ...)
                    theirs = room_of(target, rules)
                    if theirs is None:
                        errors.append(f"server/{rel}:{number}: includes \"{m.group(1)}\" "
                                      f"(server/{target}), which is in no room")
                    elif theirs < mine:
                        errors.append(
                            f"server/{rel}:{number}: room '{rules[mine][0]}' includes "
                            f"\"{m.group(1)}\" (server/{target}) of room '{rules[theirs][0]}', "
                            f"which is above it (server/LAYERS: {order(rules)})")
    return errors


def resolve(root, directory, spec):
    """The included file relative to server/, or None when it is not under server/."""
    for base in (directory, root):
        candidate = os.path.normpath(os.path.join(base, spec))
        if os.path.exists(candidate):
            break
    else:
        candidate = os.path.normpath(os.path.join(root, spec))  # generated or missing: by name
    rel = os.path.relpath(candidate, os.path.join(root, "server"))
    return None if rel.startswith("..") else rel


def check_links(root, rules):
    errors = []
    rank = {t: i for i, (_, _, targets) in enumerate(rules) for t in targets}
    for dirpath, _, files in os.walk(os.path.join(root, "server")):
        if "CMakeLists.txt" not in files:
            continue
        path = os.path.join(dirpath, "CMakeLists.txt")
        with open(path) as f:
            text = f.read()
        for m in LINK.finditer(text):
            source = m.group(1)
            if source not in rank:
                continue
            line = text.count("\n", 0, m.start()) + 1
            for dep in re.findall(r"[A-Za-z0-9_:]+", m.group(2)):
                if dep in rank and rank[dep] < rank[source]:
                    errors.append(
                        f"{os.path.relpath(path, root)}:{line}: {source} (room "
                        f"'{rules[rank[source]][0]}') links {dep} of room '{rules[rank[dep]][0]}', "
                        f"which is above it (server/LAYERS: {order(rules)})")
    return errors


def order(rules):
    return " > ".join(room for room, _, _ in rules)


def direct_includes(root, path):
    """[(line number, spelling, path under server/)] of a file's "..." includes into server/."""
    out = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                target = resolve(root, os.path.dirname(path), m.group(1))
                if target is not None:
                    out.append((number, m.group(1), target))
    return out


def check_visibility(root, rules, visible):
    """A private header (a `visible` line of LAYERS) is reached, directly or through any chain of
    headers, only from its own room and the rooms its line names."""
    errors = []
    server = os.path.join(root, "server")
    reach = {}  # path under server/ -> the private headers it reaches, itself included

    def reached(rel, stack=()):
        if rel in reach:
            return reach[rel]
        found = {rel} if rel in visible else set()
        reach[rel] = found  # a cycle of headers ends here
        path = os.path.join(server, rel)
        if os.path.exists(path) and rel not in stack:
            for _, _, target in direct_includes(root, path):
                found |= reached(target, stack + (rel,))
        return found

    for dirpath, _, files in os.walk(server):
        for name in sorted(files):
            if not name.endswith(SOURCES):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, server)
            mine = room_of(rel, rules)
            if mine is None:
                continue
            for number, spelling, target in direct_includes(root, path):
                for private in sorted(reached(target)):
                    owner = room_of(private, rules)
                    allowed = visible[private] | {rules[owner][0] if owner is not None else ""}
                    if rules[mine][0] in allowed:
                        continue
                    via = "" if private == target else f", which reaches server/{private}"
                    errors.append(
                        f"server/{rel}:{number}: room '{rules[mine][0]}' includes \"{spelling}\"{via}; "
                        f"server/{private} is visible only to {', '.join(sorted(allowed))} "
                        f"(server/LAYERS)")
    return errors


def check(root):
    rules, visible = read_layers(root)
    return (check_includes(root, rules) + check_links(root, rules) +
            check_visibility(root, rules, visible))


def self_test(root):
    """Each planted break is reported, naming its file and line; a clean tree passes."""
    with tempfile.TemporaryDirectory(prefix="layers-") as tmp:
        os.makedirs(os.path.join(tmp, "server"))
        shutil.copy(os.path.join(root, "server", "LAYERS"), os.path.join(tmp, "server", "LAYERS"))
        rules = read_rules(tmp)
        for _, where, _ in rules:
            if where.endswith("/"):
                os.makedirs(os.path.join(tmp, "server", where), exist_ok=True)
        top, low = rules[1][1], rules[-1][1]  # e.g. ops/ and optim/
        write(tmp, f"server/{top}top.h", "#pragma once\n")
        write(tmp, f"server/{low}low.h", f'#pragma once\n#include "server/{low}low2.h"\n')
        write(tmp, f"server/{low}low2.h", "#pragma once\n")
        write(tmp, f"server/{top}uses_low.cc", f'#include <vector>\n#include "server/{low}low.h"\n')
        assert check(tmp) == [], check(tmp)  # downward and same-room includes pass
        write(tmp, f"server/{low}up.cc", f'// a planted break\n#include "server/{top}top.h"\n')
        write(tmp, f"server/{low}up_relative.cc", f'\n\n#include "../{top}top.h"\n')
        write(tmp, "server/stray.cc", "int x;\n")
        # A header private to the lowest room, reached from the top room through a chain.
        with open(os.path.join(tmp, "server", "LAYERS"), "a") as f:
            f.write(f"visible {rules[-1][0]} {low}secret.h\n")
        write(tmp, f"server/{low}secret.h", "#pragma once\n")
        write(tmp, f"server/{low}face.h", f'#pragma once\n#include "server/{low}secret.h"\n')
        write(tmp, f"server/{top}uses_face.cc", f'\n#include "server/{low}face.h"\n')
        targets = rules[1][2][0], rules[-1][2][0]
        write(tmp, f"server/{low}CMakeLists.txt",
              f"target_link_libraries({targets[1]} PUBLIC {targets[0]})\n")
        errors = check(tmp)
        expected = [f"server/{low}up.cc:2: room '{rules[-1][0]}' includes \"server/{top}top.h\"",
                    f"server/{low}up_relative.cc:3: room '{rules[-1][0]}' includes "
                    f"\"../{top}top.h\" (server/{top}top.h)",
                    "server/stray.cc:1: in no room",
                    f"server/{top}uses_face.cc:2: room '{rules[1][0]}' includes "
                    f"\"server/{low}face.h\", which reaches server/{low}secret.h; "
                    f"server/{low}secret.h is visible only to {rules[-1][0]}",
                    f"server/{low}CMakeLists.txt:1: {targets[1]} (room '{rules[-1][0]}') links "
                    f"{targets[0]}"]
        for want in expected:
            if not any(e.startswith(want) for e in errors):
                print(f"self-test: not reported: {want}\ngot:\n  " + "\n  ".join(errors))
                return 1
        if len(errors) != len(expected):
            print("self-test: unexpected reports:\n  " + "\n  ".join(errors))
            return 1
    print(f"self-test: {len(expected)} planted breaks reported, each with its file and line")
    return 0


def write(root, rel, text):
    with open(os.path.join(root, rel), "w") as f:
        f.write(text)


def main(argv):
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    if argv[1:2] == ["--self-test"]:
        if self_test(root):
            return 1
        argv = argv[:1] + argv[2:]
    if len(argv) > 1:
        root = argv[1]
    errors = check(root)
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} include(s) or link(s) break the layering rule of server/LAYERS")
        return 1
    print(f"layering: server/ follows server/LAYERS ({order(read_rules(root))})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
