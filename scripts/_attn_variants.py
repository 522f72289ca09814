import sys, os
sys.path.insert(0, "src")
import pytest
import dsv4kv.kernels.attention as A
variant = sys.argv[1]
if variant == "stages1":
    A.NUM_STAGES = 1
elif variant == "f32dot":
    A.interpreted = lambda: True  # forces DOT_F32 path if it keys off interpreted()
rc = pytest.main(["tests/test_kernel_attention.py", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-x", "-k", "chunked_steps and window"])
print("VARIANT", variant, "rc", rc)
