"""Which compiled variant each kernel launch needs: Triton's specialization key, recorded per launch.

    with record_launches() as launches:
        engine.step()
    launches.keys["_sparse_attention_kernel"]   # {key, ...}: one compiled kernel each on a GPU

Triton compiles a kernel once per distinct key: the value of every `tl.constexpr` argument, the launch options
(num_warps, num_stages, ...), and for every other argument its type plus a specialization class: for ints,
== 1 (compiled in as a constant) or divisible by 16, for tensors whether the address is 16-byte aligned, unless
the kernel lists the argument in `do_not_specialize` (`do_not_specialize_on_alignment`). The key here is that one,
computed with Triton's own `native_specialize_impl`, so it can be recorded on a CPU under Triton's interpreter,
which compiles nothing. An engine step that launches a kernel with a key no earlier step had pays a compilation
on the GPU (hundreds of ms to seconds), which is why a value that changes every step (token rows, a longest
request, a split count) must not reach a key: tests/test_engine_compiles.py checks that the keys stop growing.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["Launches", "record_launches", "jit_kernels", "specialization_key"]

_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg", "launch_pdl")


def jit_kernels() -> dict[str, object]:
    """Every `@triton.jit` kernel of dsv4kv.ops that a wrapper launches (name -> JITFunction, or
    InterpretedFunction under TRITON_INTERPRET=1)."""
    from .. import kernels as _every_kernel_module  # noqa: F401 (importing them registers their kernels)

    kernels = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("dsv4kv.ops."):
            continue
        for attr, value in vars(module).items():
            if attr.endswith("_kernel") and hasattr(value, "run") and hasattr(value, "fn"):
                kernels[attr] = value
    return kernels


def _not_specialized(kernel, option: str) -> set[str]:
    """Parameter names the kernel lists under `option` (do_not_specialize...), by name or index."""
    listed = getattr(kernel, option, None)
    if listed is None:  # the interpreter keeps jit's keyword arguments
        listed = getattr(kernel, "kwargs", {}).get(option)
    names = list(inspect.signature(kernel.fn).parameters)
    return {names[x] if isinstance(x, int) else x for x in (listed or ())}


def specialization_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """Triton's cache key of a launch `kernel[grid](*args, **kwargs)`, as a hashable tuple of (name, key) pairs."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature = inspect.signature(kernel.fn)
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    plain = _not_specialized(kernel, "do_not_specialize")
    unaligned = _not_specialized(kernel, "do_not_specialize_on_alignment")
    key = []
    for name, value in bound.arguments.items():
        if "constexpr" in str(signature.parameters[name].annotation):
            key.append((name, ("constexpr", str(value))))
        else:
            key.append((name, tuple(native_specialize_impl(BaseBackend, value, False, name not in plain,
                                                           name not in unaligned))))
    key += [(name, ("option", kwargs[name])) for name in _OPTIONS if name in kwargs]
    return tuple(key)


@dataclass
class Launches:
    """What `record_launches` saw: per kernel, the distinct keys, and every launch in order (step, name, key)."""

    keys: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    log: list[tuple[int, str, tuple]] = field(default_factory=list)
    step: int = 0  # the caller's label for the launches that follow (e.g. the engine step)

    def distinct(self) -> int:
        return sum(len(v) for v in self.keys.values())

    def new_keys(self, step: int) -> list[tuple[str, tuple]]:
        """The (kernel, key) pairs first seen at `step`."""
        seen, new = set(), []
        for s, name, key in self.log:
            if (name, key) not in seen:
                seen.add((name, key))
                if s == step:
                    new.append((name, key))
        return new


@contextlib.contextmanager
def record_launches(launch: bool = True):
    """Record the specialization key of every dsv4kv kernel launch inside the block (and still launch it, unless
    `launch` is False)."""
    launches = Launches()
    kernels = jit_kernels()

    def recording(name, kernel, run):
        def wrapped(*args, grid, warmup, **kwargs):
            key = specialization_key(kernel, args, kwargs)
            launches.keys[name].add(key)
            launches.log.append((launches.step, name, key))
            return run(*args, grid=grid, warmup=warmup, **kwargs) if launch else None
        return wrapped

    for name, kernel in kernels.items():  # kernel[grid](...) calls self.run: an instance attribute overrides it
        kernel.run = recording(name, kernel, kernel.run)
    try:
        yield launches
    finally:
        for kernel in kernels.values():
            del kernel.run
