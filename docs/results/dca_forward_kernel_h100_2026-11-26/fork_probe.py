"""After the forkserver's preload imports, can a forked child use CUDA?"""
import os
import sys

steps = sys.argv[1:]
import torch  # noqa: E402

for name in steps:
    __import__(name)


def child() -> None:
    try:
        print("child capturing:", torch.cuda.is_current_stream_capturing(), flush=True)
        print("child zeros:", torch.zeros(1, device="cuda").item(), flush=True)
    except Exception as e:  # noqa: BLE001
        print("child FAILED:", type(e).__name__, str(e).splitlines()[0], flush=True)


pid = os.fork()
if pid == 0:
    child()
    os._exit(0)
os.waitpid(pid, 0)
