"""deploy/quickstart_progress.py on synthetic input: Ninja status lines become plain progress lines
in muonctl's form ending at 100% "done in", other lines pass through in order; the training form
passes every line through (and into --log) and counts step rows up to the given total; on a
terminal the bar is redrawn in place and ends at 100%."""
import os
import re
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "quickstart_progress.py")
PLAIN = re.compile(r"^progress: (.+): (\d+)/(\d+) (targets|steps) \((\d+\.\d)%\), "
                   r"(\d+\.\d\d (targets|steps)/s|-), ((\d+:\d\d(:\d\d)?|-) left|done in \d+:\d\d(:\d\d)?)$")


def run(args, text):
    # Bytes, not text mode: universal newlines would turn the terminal form's '\r' into '\n'.
    r = subprocess.run([sys.executable, SCRIPT] + args, input=text.encode(), capture_output=True,
                       timeout=60, check=True)
    return r.stdout.decode()


def progress_lines(out):
    return [l for l in out.splitlines() if l.startswith("progress: ")]


def check_plain(out, what, total):
    lines = progress_lines(out)
    assert lines, out
    done = []
    for l in lines:
        m = PLAIN.match(l)
        assert m, f"not a plain progress line: {l!r}"
        assert m.group(1) == what and int(m.group(3)) == total, l
        done.append(int(m.group(2)))
    assert done == sorted(done), done
    assert done[-1] == total and lines[-1].split("(")[1].startswith("100.0%"), lines[-1]
    assert "done in" in lines[-1] and all("done in" not in l for l in lines[:-1]), lines
    return lines


def main():
    ninja = "".join(f"[{i}/40] Building CXX object x{i}.o\n" for i in range(1, 41))
    ninja = ninja.replace("[7/40]", "x.cc:1:2: warning: something\n[7/40]")
    out = run(["build", "--every", "0"], ninja)
    lines = check_plain(out, "build", 40)
    assert len(lines) == 40, len(lines)  # 39 updates and the final line; none for 40/40 itself
    assert out.splitlines()[6] == "x.cc:1:2: warning: something", out.splitlines()[:8]

    train = "muond job 'j': 2 ranks\n step   loss (muond)  loss (in-process)     |diff|\n"
    train += "".join(f"{s:>5} {4 - s / 10:>14.6f} {4 - s / 10:>18.6f}   0.00e+00\n" for s in range(12))
    train += "12 steps in 3.0 s; largest |loss(muond) - loss(in-process)| = 2.384e-07 (step 1)\n"
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "train.log")
        out = run(["train", "--steps", "12", "--label", "training", "--log", log, "--every", "0"],
                  train)
        assert open(log).read() == train
    check_plain(out, "training", 12)
    passed = [l for l in out.splitlines() if not l.startswith("progress: ")]
    assert passed == train.splitlines(), passed

    out = run(["train", "--steps", "12", "--label", "training", "--tty", "yes"], train)
    bars = re.findall(r"\r(training  \[[#-]{30}\] +\d+\.\d%[^\r\n\x1b]*)", out)
    assert len(bars) >= 12, bars
    assert bars[-1].startswith("training  [" + "#" * 30 + "]  100.0%  12/12 steps"), bars[-1]
    assert out.endswith("\n"), repr(out[-40:])
    print(f"build: {len(lines)} lines to 100%; training: plain and terminal forms to 12/12 steps")


if __name__ == "__main__":
    main()
