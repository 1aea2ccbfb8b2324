"""trainer.distributed.exit_process: Python's own exit work, then no native teardown."""

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from trainer.distributed import exit_process

    out = Path(sys.argv[1])
    # An idle worker of a thread pool nobody shut down, as torch.compile's inductor leaves one.
    pool = ThreadPoolExecutor(max_workers=2)
    pool.submit(lambda: None).result()
    # A thread still at work at exit (a checkpoint committing): the exit waits for it.
    threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    print("printed before exit", end="")
    exit_process(3)
""")


def test_exit_waits_for_threads_runs_atexit_and_does_not_wait_on_an_idle_pool(tmp_path):
    # Before exit_process ran threading's exit hooks it joined the pool's idle worker for ever.
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "printed before exit"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
