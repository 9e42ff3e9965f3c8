#!/usr/bin/python3
"""Progress for deploy/quickstart.sh: reads a command's output on stdin and shows how far it is.

  quickstart_progress.py build
      stdin: `cmake --build` (Ninja) output. Its status lines "[N/M] ..." become progress in
      targets; every other line (compiler errors and warnings, FAILED) is passed through.
  quickstart_progress.py train --steps N --label LABEL [--log FILE]
      stdin: client/examples/train_tiny_gpt.py output. Every line is passed through (and copied
      to FILE); its step rows ("  STEP  LOSS  LOSS  DIFF") advance the progress in steps.

On a terminal a bar is redrawn in place below the passed-through lines; otherwise plain lines, in
the form muonctl uses (client/progress_display.h), at most one per `--every` seconds (default 5)
and always the last; the rate is measured from the first step (or target) seen, so start-up time
does not count:
  progress: build: 120/431 targets (27.8%), 3.10 targets/s, 1:40 left
  progress: build: 431/431 targets (100.0%), 3.05 targets/s, done in 2:21
"""
import argparse
import math
import re
import sys
import time

NINJA = re.compile(r"^\[(\d+)/(\d+)\] ")
STEP_ROW = re.compile(r"^\s*(\d+)\s+-?\d+\.\d+\s+-?\d+\.\d+\s+\d")


def clock(seconds):
    s = int(round(max(0.0, seconds)))
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def plain_line(what, unit, done, total, rate, elapsed, final):
    shown = min(done, total) if total else done
    frac = shown / total if total else 0.0
    rate_text = f"{rate:.2f} {unit}/s" if rate > 0 else "-"
    if final:
        tail = f"done in {clock(elapsed)}"
    else:
        tail = (clock((total - shown) / rate) if rate > 0 and total else "-") + " left"
    return f"progress: {what}: {shown}/{total} {unit} ({100 * frac:.1f}%), {rate_text}, {tail}"


def bar_line(what, unit, done, total, rate, width=30):
    shown = min(done, total) if total else done
    frac = shown / total if total else 0.0
    left = clock((total - shown) / rate) if rate > 0 and total else "-"
    filled = int(math.floor(frac * width))
    return (f"{what}  [{'#' * filled}{'-' * (width - filled)}]  {100 * frac:5.1f}%  "
            f"{shown}/{total} {unit}  {rate:.2f} {unit}/s  {left} left")


class Progress:
    def __init__(self, what, unit, out, tty, every):
        self.what, self.unit, self.out, self.tty, self.every = what, unit, out, tty, every
        self.start = time.monotonic()
        self.last = None
        self.state = None  # (done, total)
        self.base = None  # (done, time) at the first update: the rate is measured from there
        self.bar_shown = False

    def _elapsed(self):
        return time.monotonic() - self.start

    def _rate(self):
        if self.base is None or self.state is None:
            return 0.0
        dt = time.monotonic() - self.base[1]
        return (self.state[0] - self.base[0]) / dt if dt > 0 else 0.0

    def passthrough(self, line):
        if self.bar_shown:
            self.out.write("\r\033[K")
        self.out.write(line if line.endswith("\n") else line + "\n")
        if self.tty and self.state:
            self._draw_bar()
        self.out.flush()

    def _draw_bar(self):
        self.out.write("\r" + bar_line(self.what, self.unit, *self.state, self._rate()) + "\033[K")
        self.bar_shown = True

    def update(self, done, total):
        self.state = (done, total)
        now = time.monotonic()
        if self.base is None:
            self.base = (done, now)
        if self.tty:
            self._draw_bar()
        elif done >= total > 0:
            pass  # the last line is finish()'s
        elif self.last is None or now - self.last >= self.every:
            self.out.write(plain_line(self.what, self.unit, done, total, self._rate(),
                                      self._elapsed(), False) + "\n")
            self.last = now
        self.out.flush()

    def finish(self):
        if self.state is None:
            return
        if self.tty:
            self._draw_bar()
            self.out.write("\n")
        else:
            self.out.write(plain_line(self.what, self.unit, *self.state, self._rate(),
                                      self._elapsed(), True) + "\n")
        self.out.flush()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=("build", "train"))
    ap.add_argument("--steps", type=int, default=0, help="train: steps the run will take")
    ap.add_argument("--label", default=None)
    ap.add_argument("--log", default=None, help="train: copy every line here")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between plain lines")
    ap.add_argument("--tty", choices=("auto", "yes", "no"), default="auto")
    args = ap.parse_args(argv)
    if args.kind == "train" and args.steps <= 0:
        ap.error("train needs --steps N (N > 0)")
    tty = sys.stdout.isatty() if args.tty == "auto" else args.tty == "yes"
    unit = "targets" if args.kind == "build" else "steps"
    p = Progress(args.label or args.kind, unit, sys.stdout, tty, args.every)
    log = open(args.log, "w") if args.log else None
    first_step = None
    for line in sys.stdin:
        if log:
            log.write(line)
            log.flush()
        if args.kind == "build":
            m = NINJA.match(line)
            if m:
                p.update(int(m.group(1)), int(m.group(2)))
                continue
            p.passthrough(line)
            continue
        p.passthrough(line)
        m = STEP_ROW.match(line)
        if m:
            step = int(m.group(1))
            first_step = step if first_step is None else first_step
            p.update(step + 1, args.steps)
    p.finish()
    if log:
        log.close()


if __name__ == "__main__":
    main()
