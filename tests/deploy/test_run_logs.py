"""`make run` streams every service's output line by line, prefixed by the service."""

import io
import subprocess
import sys

from scripts.cluster import LogPrefixer


def test_each_line_reaches_the_stream_whole_and_prefixed_by_its_service():
    out = io.StringIO()
    prefixer = LogPrefixer(out, width=8)
    code = "import sys\nfor i in range(200): print(f'{sys.argv[1]} line {i} ' + 'x' * 300)"
    procs = {
        name: subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE)
        for name in ("router", "decode")
    }
    for name, proc in procs.items():
        prefixer.follow(name, proc.stdout)
    for proc in procs.values():
        proc.wait(timeout=30)
    prefixer.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 400
    for line in lines:
        label, text = line.split("| ", 1)
        assert text.startswith(label.strip() + " line ") and text.endswith("x" * 300)
