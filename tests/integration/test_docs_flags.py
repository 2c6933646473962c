#!/usr/bin/python3
"""The daemon's --help and the documentation agree on every flag.

  1. docs/reference.md's "flashckptd flags" table (README: "Every flag") lists exactly the flags
     `flashckptd --help` prints, no more and no fewer;
  2. where --help states a default (`=N` after the type, or "(default: X)" in the text), the table's
     default column says the same;
  3. every flag the README or docs/operating.md shows on a flashckptd command line, and every
     "`flashckptd --flag ...` (N by default" in the README, is a flag of --help with that default;
  4. the README links to the table.

    test_docs_flags.py --build-dir build --source-dir .
"""

import argparse
import os
import re
import subprocess
import sys


class Mismatch(Exception):
    pass


def help_flags(daemon):
    """{flag: default or None} from `flashckptd --help` (CLI11's layout: one option per line, `=DEFAULT`
    after the type, a description that may say "(default: X)")."""
    out = subprocess.run([daemon, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30,
                         check=True).stdout.decode()
    flags = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"^\s{2}(?:-\w,)?(--[a-z][a-z0-9-]*)(.*)$", line)
        if m:
            current = m.group(1)
            rest = m.group(2)
            typed = re.match(r"^\s+[A-Z]+(?::[A-Z]+)?(?: in \[[^\]]*\])?=(\S+)", rest)
            flags[current] = typed.group(1) if typed else None
            text = rest
        elif current and line.startswith(" " * 10):
            text = line
        else:
            current = None
            continue
        said = re.search(r"\(default:? ([^)]*)\)", text)
        if said and flags[current] is None:
            flags[current] = said.group(1).strip()
    if "--socket" not in flags or len(flags) < 10:
        raise Mismatch("could not read the flags of --help:\n" + out)
    return flags


def table_flags(reference):
    """{flag: default column} of the "## flashckptd flags" table of docs/reference.md."""
    with open(reference) as f:
        text = f.read()
    section = re.search(r"^## flashckptd flags\n(.*?)(?=^## )", text, re.M | re.S)
    if not section:
        raise Mismatch("%s has no '## flashckptd flags' section" % reference)
    flags = {}
    for row in section.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)", cells[0]):
            if flag in flags:
                raise Mismatch("%s lists %s twice" % (reference, flag))
            flags[flag] = cells[1].strip("`")
    return flags


def same_default(help_default, table_default):
    h = help_default.strip("`'\"")
    t = table_default.strip("`'\"")
    if h == t:
        return True
    # "0: only --max-host-memory" in the help's words may be "0" in the table, and the other way round.
    return h.split()[0].rstrip(":;,") == t.split()[0].rstrip(":;,") if h and t else False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    source = os.path.abspath(args.source_dir)
    daemon = os.path.join(os.path.abspath(args.build_dir), "bin", "flashckptd")
    reference = os.path.join(source, "docs", "reference.md")
    problems = []

    helped = help_flags(daemon)
    helped.pop("--help", None)
    table = table_flags(reference)
    table.pop("--help", None)

    # 1. The same set of flags.
    for flag in sorted(set(helped) - set(table)):
        problems.append("%s is in flashckptd --help but not in docs/reference.md's flag table" % flag)
    for flag in sorted(set(table) - set(helped)):
        problems.append("docs/reference.md's flag table lists %s, which flashckptd --help does not have" % flag)

    # 2. The same defaults.
    compared = 0
    for flag, default in sorted(helped.items()):
        if default is None or flag not in table:
            continue
        compared += 1
        if not same_default(default, table[flag]):
            problems.append("%s: --help says the default is %r, docs/reference.md says %r" % (flag, default, table[flag]))

    # 3. Flags shown on flashckptd command lines in the README and the operator's guide.
    shown = 0
    for doc in ("README.md", os.path.join("docs", "operating.md")):
        with open(os.path.join(source, doc)) as f:
            text = f.read()
        lines = [m.group(0) for m in re.finditer(r"`flashckptd[^`]*`", text)]
        lines += [ln for ln in text.splitlines() if re.match(r"^\s*flashckptd\s", ln)]  # in code blocks
        for command in lines:
            for flag in re.findall(r"\s(--[a-z][a-z0-9-]*)", command):
                shown += 1
                if flag not in helped and flag != "--help":
                    problems.append("%s shows `%s`, which flashckptd --help does not have" % (doc, flag))
        if doc == "README.md":
            for flag, default in re.findall(r"`flashckptd (--[a-z][a-z0-9-]*)[^`]*` \((\S+) by default", text):
                shown += 1
                if flag in helped and not same_default(helped[flag] or "", default):
                    problems.append("README.md says %s is %s by default, --help says %r" % (flag, default, helped[flag]))
            # 4. The README points at the table.
            if "docs/reference.md#flashckptd-flags" not in text:
                problems.append("README.md does not link docs/reference.md#flashckptd-flags (every flag)")

    print("flashckptd --help: %d flags; docs/reference.md: %d; defaults compared: %d; flags on documented "
          "command lines checked: %d" % (len(helped), len(table), compared, shown))
    if problems:
        print("FAILED: the documentation and --help disagree:\n  " + "\n  ".join(problems))
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
