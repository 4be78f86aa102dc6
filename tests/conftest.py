"""Test-wide settings: Triton kernels run through the interpreter when there is no GPU."""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the data sets' token cache (sim.datasets.token_cache_dir): a folder of this run's, not the user's
os.environ["KVTWIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvtwin-test-cache-")
atexit.register(shutil.rmtree, os.environ["KVTWIN_CACHE_DIR"], ignore_errors=True)

try:  # must precede any @triton.jit decoration (the knob is read then)
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
except ImportError:  # the simulator's tests run without the engine extra
    pass
