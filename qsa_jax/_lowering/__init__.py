"""The JAX accelerator: each launch bound and re-lowered for less host time (``qsa_jax._binding.hook``).

Everything here saves host time and nothing else: with ``QSA_ACCELERATE=0``
jax-triton binds and lowers every launch itself (the binding alone), with
the same kernels, arguments and bits; delete this package and the binding
still works.  jax-triton compiles every kernel and builds jaxlib's serialized call proto
(the kernel's PTX and launch parameters); how the launch then reaches XLA is
one of three lowerings:

* ``"ffi"``: jaxlib's typed-FFI handler ``triton_kernel_call_ffi`` (API
  version 4, the call proto as an ``opaque`` attribute).  XLA instantiates it
  once per executable and, because the handler is command-buffer compatible,
  records consecutive launches into one CUDA graph (a ``kCommandBuffer``
  thunk) instead of dispatching each from the host.
* ``"legacy"``: jaxlib's untyped ``triton_kernel_call`` (API version 2, the
  proto as ``backend_config``), which XLA dispatches one by one and hashes
  (PTX included) on every call.
* ``"jax-triton"``: jax-triton's own lowering, untouched (0.3.x emits the
  legacy call, 0.4.x the FFI call), with jax-triton's whole payload.

``"ffi"`` and ``"legacy"`` replace jax-triton's lowering rule for this
package's launches: jax-triton's rule emits its call, this module reads the
proto back, slims it (:func:`._proto.slim_call_proto`: no TTIR, the PTX minified;
jaxlib copies and hashes it per launch with some versions, so its size is host
time) and emits the chosen call with the same operands, results and aliases
(``QSA_JAX_PTX=full``, or :func:`ptx_form`, keeps Triton's PTX as is). That
relies on private internals of jax-triton and jaxlib, so it is used only with
the versions :data:`VERIFIED` lists; elsewhere ``"auto"`` (the default) falls
back to ``"jax-triton"``. ``"auto"`` otherwise takes ``"ffi"`` where jaxlib
registers the FFI handler. ``QSA_JAX_LOWERING`` (read at import) or
:func:`use_triton_lowering` names one instead; naming ``"ffi"`` or
``"legacy"`` forces the private path even outside the table (with a warning).
Every lowering launches the same compiled kernel with the same arguments, so
results are bitwise equal.

Binding: jax-triton 0.3's ``triton_call`` gives every output a pointer of
its own (aliased ones too, as this package's kernels expect: torch passes an
in-place tensor twice) and makes every keyword a compile-time constant.
0.4's gives an aliased output no pointer, so for 0.4 launches are bound to
its primitive directly with 0.3's layout (inputs, every output, then the
scalars, which 0.4 passes at run time as torch does).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.metadata
import os
import re
import warnings

import jax

from qsa_kernels import runtime
from qsa_kernels.launch import Launch, kernel_name

from .. import _binding
from .._binding import CUSTOM_CALL_TARGETS
from . import _proto

LEGACY_TARGET, FFI_TARGET = CUSTOM_CALL_TARGETS
LOWERINGS = ("auto", "ffi", "legacy", "jax-triton")
_ENVIRONMENT = "QSA_JAX_LOWERING"
#: What PTX text the ``"ffi"`` and ``"legacy"`` lowerings put in the call proto:
#: ``"minified"`` (the default: :func:`minify_ptx`) or ``"full"`` (Triton's, as is).
PTX_FORMS = ("minified", "full")
_PTX_ENVIRONMENT = "QSA_JAX_PTX"


# --------------------------------------------------------------------------
# The versions whose private internals were checked
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Verified:
    """Releases ``first`` to ``last`` (inclusive) of ``package`` have what ``uses`` says, as checked ``where``."""

    package: str
    first: str
    last: str
    uses: str
    where: str

    def admits(self, version: str | None) -> bool:
        release = _release(version)
        return release is not None and _release(self.first) <= release <= _release(self.last)


_JAXLIB_USES = (
    "the call proto's wire layout (TritonAnyKernelCall.kernel_call(1).kernel(1).ttir(5), which "
    "_slim_call_proto drops, and .ptx(4), the text jaxlib's ptxas compiles, which it minifies); "
    "jaxlib.gpu_triton._cuda_triton.registrations() naming triton_kernel_call_ffi, "
    "whose handler reads the proto from its opaque attribute (API version 4); the legacy "
    "triton_kernel_call target (API version 2, the proto as backend_config)")

#: What the ``"ffi"`` and ``"legacy"`` lowerings (and jax-triton 0.4's direct
#: bind) rely on, per package and release range, and where it was checked.
#: ``"auto"`` uses them only where both the installed jax-triton and jaxlib
#: are listed.  Extend a row only after checking the new release the same way.
VERIFIED = (
    Verified("jax-triton", "0.3.1", "0.3.1",
             uses="triton_lib.triton_kernel_call_p and triton_kernel_call_lowering(get_cuda_backend, ...), "
                  "which emits the legacy call with the compressed proto as its backend_config; "
                  "the public triton_call (out_shape, every keyword a constant) binds the launches",
             where="GPU: H200 with jaxlib 0.11.2 and triton 3.6.0 (the suite, ffi and legacy); CPU: "
                   "scripts/check_jax_lowering.py with jaxlib 0.11.2 (triton 3.6.0) and 0.12.0.1 (triton 3.9.0)"),
    Verified("jax-triton", "0.4.0", "0.4.1",
             uses="triton_lib.triton_kernel_call_p bound directly (an in_tree of _StaticArg and "
                  "_OutputPlaceholder leaves, FrozenDict parameters, TritonFunction's parameter lists); "
                  "triton_kernel_call_lowering(make_cuda_target, ...), which emits the FFI call with the "
                  "compressed proto in its opaque attribute",
             where="CPU only: source read (0.4.0, 0.4.1); scripts/check_jax_lowering.py with 0.4.1 on jaxlib "
                   "0.11.2 (triton 3.7.1) and 0.12.0.1 (triton 3.9.0), 0.4.0 on 0.12.0.1; never run on a GPU"),
    Verified("jaxlib", "0.11.2", "0.11.2", uses=_JAXLIB_USES,
             where="GPU: H200 (the suite, ffi and legacy); CPU: the CUDA 13 plugin's to_proto() decoded, "
                   "scripts/check_jax_lowering.py"),
    Verified("jaxlib", "0.12.0", "0.12.0.1", uses=_JAXLIB_USES,
             where="CPU only: both CUDA 13 plugins' registrations() and TritonKernelCall.to_proto() decoded; "
                   "scripts/check_jax_lowering.py with 0.12.0.1; never run on a GPU"),
)


def _release(version: str | None) -> tuple[int, ...] | None:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; ``None`` for a pre-, dev- or post-release, which no row admits."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)(\+.*)?", version or "")
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def verified(package: str, version: str | None) -> Verified | None:
    """The :data:`VERIFIED` row admitting ``version`` of ``package``, or ``None``."""
    return next((row for row in VERIFIED if row.package == package and row.admits(version)), None)


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _versions() -> tuple[str | None, str | None]:
    """``(jax-triton, jaxlib)`` as installed (``None``: absent), read from their metadata: no import."""
    return _installed("jax-triton"), _installed("jaxlib")


@functools.cache
def _ffi_registered() -> bool:
    """Whether the installed jaxlib registers ``triton_kernel_call_ffi`` for CUDA
    (read from jaxlib's handler table: no device call)."""
    try:
        import jaxlib.gpu_triton as gpu_triton
    except ImportError:  # pragma: no cover - jaxlib without GPU Triton support
        return False
    plugin = getattr(gpu_triton, "_cuda_triton", None)
    registrations = getattr(plugin, "registrations", None)
    try:
        return bool(registrations) and FFI_TARGET in registrations()
    except Exception:  # an unverified jaxlib whose table reads otherwise: no FFI
        return False


def _private_verified(jax_triton: str | None, jaxlib: str | None) -> bool:
    return verified("jax-triton", jax_triton) is not None and verified("jaxlib", jaxlib) is not None


# --------------------------------------------------------------------------
# The lowering in force: a context variable (per thread and per context)
# --------------------------------------------------------------------------

_requested: contextvars.ContextVar[str] = contextvars.ContextVar(
    "qsa_jax_triton_lowering", default=os.environ.get(_ENVIRONMENT, "auto").strip().lower() or "auto")
_warned: set[tuple] = set()


def _check_name(name: str, what: str) -> None:
    if name not in LOWERINGS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, LOWERINGS))}, got {name!r}")


def _choose(name: str, jax_triton: str | None, jaxlib: str | None, ffi_registered: bool) -> str:
    """The lowering ``name`` resolves to with these versions (no side effect: the tests call it)."""
    if name == "auto":
        if not _private_verified(jax_triton, jaxlib):
            return "jax-triton"
        return "ffi" if ffi_registered else "legacy"
    if name == "ffi" and not ffi_registered:
        raise RuntimeError(f"the ffi lowering needs jaxlib's {FFI_TARGET} handler (jaxlib >= 0.11), which this "
                           f"jaxlib ({jaxlib}) does not register: use 'legacy', 'jax-triton' or 'auto'")
    return name


def _resolve(name: str) -> str:
    jax_triton, jaxlib = _versions()
    lowering = _choose(name, jax_triton, jaxlib, _ffi_registered())
    key = (lowering, jax_triton, jaxlib)
    if lowering in ("ffi", "legacy") and not _private_verified(jax_triton, jaxlib) and key not in _warned:
        _warned.add(key)
        warnings.warn(f"qsa_jax: the {lowering!r} lowering was asked for, but jax-triton {jax_triton} with jaxlib "
                      f"{jaxlib} is not among the versions it was verified with (qsa_jax._lowering.VERIFIED): "
                      f"it relies on their private internals; 'jax-triton' (or 'auto') avoids them",
                      RuntimeWarning, stacklevel=3)
    return lowering


def triton_lowering_available(name: str) -> bool:
    """Whether launches can lower the ``name`` way here without forcing: ``"auto"`` and
    ``"jax-triton"`` in any compiled process; ``"legacy"`` and ``"ffi"`` where the installed
    jax-triton and jaxlib are verified (``"ffi"``: and jaxlib registers its FFI handler)."""
    _check_name(name, "lowering")
    if runtime.INTERPRETED:
        return False
    if name in ("auto", "jax-triton"):
        return True
    return _private_verified(*_versions()) and (name != "ffi" or _ffi_registered())


def triton_lowering() -> str:
    """How Triton launches traced from now on reach XLA: ``"ffi"``, ``"legacy"`` or
    ``"jax-triton"`` (``"interpreter"`` in a process without a CUDA device, where every
    launch runs from a host callback instead)."""
    name = _requested.get()
    _check_name(name, _ENVIRONMENT)
    return "interpreter" if runtime.INTERPRETED else _resolve(name)


@contextlib.contextmanager
def use_triton_lowering(name: str):
    """Lower the Triton launches traced inside the block the ``name`` way
    (``"auto"``, ``"ffi"``, ``"legacy"`` or ``"jax-triton"``; the default is the
    ``QSA_JAX_LOWERING`` environment variable, else ``"auto"``).

    The choice is a context variable: it holds for the current thread (and
    context) only, and nested blocks restore the outer choice on exit.  A
    jitted function is traced at its first call for given shapes: call (or
    ``.lower()``) it inside the block; JAX reuses that trace, lowering
    included, for later calls of the same function wherever they are made.
    Raises at entry if ``name`` cannot be used here.  No effect in a process
    without a CUDA device.
    """
    _check_name(name, "lowering")
    if not runtime.INTERPRETED:
        _resolve(name)
    token = _requested.set(name)
    try:
        yield
    finally:
        _requested.reset(token)


_ptx_requested: contextvars.ContextVar[str] = contextvars.ContextVar(
    "qsa_jax_ptx_form", default=os.environ.get(_PTX_ENVIRONMENT, "minified").strip().lower() or "minified")


def _ptx_in_force() -> str:
    name = _ptx_requested.get()
    _check_ptx(name, _PTX_ENVIRONMENT)
    return name


def _check_ptx(name: str, what: str) -> None:
    if name not in PTX_FORMS:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, PTX_FORMS))}, got {name!r}")


@contextlib.contextmanager
def ptx_form(name: str):
    """Put the ``name`` form of each kernel's PTX (``"minified"`` or ``"full"``) in the call protos
    of the ``"ffi"`` and ``"legacy"`` launches traced inside the block (the default: the
    ``QSA_JAX_PTX`` environment variable, else ``"minified"``).  A context variable, decided at
    trace time like :func:`use_triton_lowering`; ``"jax-triton"`` launches keep jax-triton's whole
    payload either way.  Both forms assemble to the same machine code (``minify_ptx``)."""
    _check_ptx(name, "PTX form")
    token = _ptx_requested.set(name)
    try:
        yield
    finally:
        _ptx_requested.reset(token)


def lowering_reason() -> str:
    """One line saying which lowering is in force and why (for ``qsa-info``)."""
    name = _requested.get()
    _check_name(name, _ENVIRONMENT)
    if runtime.INTERPRETED:
        return "interpreter: no CUDA device, so every launch runs from a host callback on CPU torch tensors"
    lowering, (jax_triton, jaxlib) = _resolve(name), _versions()
    if name != "auto":
        why = f"{_ENVIRONMENT}={name} (or use_triton_lowering) asks for it"
    elif lowering == "jax-triton":
        why = (f"auto, and jax-triton {jax_triton} with jaxlib {jaxlib} is not among the versions the package's "
               f"own lowering was verified with, so jax-triton lowers its launches itself")
    elif lowering == "ffi":
        why = f"auto, and jaxlib {jaxlib} registers the typed-FFI handler {FFI_TARGET}"
    else:
        why = f"auto, and jaxlib {jaxlib} has no typed-FFI Triton handler"
    return f"{lowering}: {why}"


# --------------------------------------------------------------------------
# Importing jax-triton and replacing its lowering rule for our launches
# --------------------------------------------------------------------------

# Each launch's name says how it lowers, so that the decision made at trace
# time (in the tracing thread's context) is the one the rule applies, and so
# that the rule changes only this package's launches: other jax-triton users
# (and our "jax-triton" launches) keep jax-triton's own lowering.
_NAME_PREFIX = {"ffi": "qsa-ffi:", "legacy": "qsa-legacy:", "jax-triton": "qsa:"}
_FULL_PTX = "ptx=full:"  # after the prefix: this launch keeps Triton's PTX as is (ptx_form("full"))


def _lowering_of(name: str) -> str | None:
    """``"ffi"`` or ``"legacy"`` for a launch this module's rule re-lowers, else ``None``."""
    return next((lowering for lowering in ("ffi", "legacy") if name.startswith(_NAME_PREFIX[lowering])), None)


_rule_installed = False


def _install_lowering(jax_triton) -> None:
    """Register, for CUDA, a lowering of jax-triton's primitive that re-lowers our ``"ffi"`` and
    ``"legacy"`` launches (:func:`_lowering_of`) and hands every other launch to jax-triton's rule."""
    global _rule_installed
    if _rule_installed:
        return
    import triton
    from jax.extend.mlir import ir
    from jax.interpreters import mlir

    lib = jax_triton.triton_lib
    try:
        target = lib.get_cuda_backend if _binding.jax_triton_api(jax_triton) == "0.3" else lib.make_cuda_target
        own_rule = functools.partial(lib.triton_kernel_call_lowering, target)
        primitive = lib.triton_kernel_call_p
    except AttributeError as error:
        raise RuntimeError(f"jax-triton {jax_triton.__version__} lacks what the ffi and legacy lowerings use "
                           f"({error}): use QSA_JAX_LOWERING=jax-triton (or auto)") from None

    def rule(ctx, *operands, name, **params):
        lowering = _lowering_of(name)
        if lowering is None:  # not one of ours to re-lower: jax-triton's lowering, untouched
            return own_rule(ctx, *operands, name=name, **params)
        with triton.knobs.compilation.scope():  # line info: debug text only, the code is the same
            triton.knobs.compilation.disable_line_info = True
            results = own_rule(ctx, *operands, name=name, **params)
        op = results[0].owner
        full_ptx = name[len(_NAME_PREFIX[lowering]):].startswith(_FULL_PTX)
        proto = _proto.slim_call_proto(_proto.payload(op, ir), minify=not full_ptx)
        op.erase()
        # Our launches bind the arrays first, so operand indices are array indices in either version.
        aliases = dict(params["input_output_aliases"])
        if lowering == "ffi":
            return jax.ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=aliases)(
                ctx, *operands, opaque=proto)
        return jax.ffi.ffi_lowering(LEGACY_TARGET, api_version=2, backend_config=proto,
                                    operand_output_aliases=aliases)(ctx, *operands)

    mlir.register_lowering(primitive, rule, platform="cuda")
    _rule_installed = True



# --------------------------------------------------------------------------
# Binding one launch, and the hook
# --------------------------------------------------------------------------

def _bind_04(jax_triton, launch: Launch, inputs: list, outputs: list, name: str) -> list:
    """jax-triton 0.4's primitive bound as its ``triton_call`` would, but with a pointer for every
    output (aliased ones too), so that the kernel's parameters are 0.3's: inputs, outputs, scalars."""
    lib = jax_triton.triton_lib
    fn = lib.TritonFunction(launch.kernel)
    metaparams = {p: fn.param_defaults[p] for p in fn.constexpr_param_names if p in fn.param_defaults}
    metaparams.update(launch.constexprs)
    scalars = fn.non_constexpr_param_names[len(inputs) + len(outputs):]
    leaves = [*inputs, *map(lib._OutputPlaceholder, range(len(outputs))),
              *(lib._StaticArg(launch.scalars[p]) for p in scalars)]
    arrays, in_tree = jax.tree_util.tree_flatten(leaves)
    return lib.triton_kernel_call_p.bind(
        *arrays, fn=launch.kernel, name=name, in_tree=in_tree, out_shapes=tuple(_binding.out_types(outputs)),
        grid=launch.grid, compute_capability=None,
        backend_options=lib.FrozenDict({"num_warps": launch.num_warps, "num_stages": launch.num_stages,
                                        "debug": False, "num_ctas": 1}),
        input_output_aliases=lib.FrozenDict(launch.aliases()), zeroed_outputs=(), serialized_metadata=b"",
        cost_estimate=None, has_side_effect=False, metaparams=lib.FrozenDict(metaparams))



class JaxAccelerator:
    """The hook's methods (:class:`qsa_jax._binding.Accelerator`)."""

    def launcher(self, jax_triton):
        lowering = triton_lowering()
        version = _versions()[0]
        if lowering == "jax-triton" and (_binding.jax_triton_api(jax_triton) == "0.3" or not verified(
                "jax-triton", version)):
            return None  # jax-triton's own binding and lowering: the binding's
        if lowering != "jax-triton":
            _install_lowering(jax_triton)
        bind = _binding.call_03 if _binding.jax_triton_api(jax_triton) == "0.3" else _bind_04
        prefix = _NAME_PREFIX[lowering] + (_FULL_PTX if lowering != "jax-triton" and _ptx_in_force() == "full"
                                           else "")
        return lambda launch, inputs, outputs: bind(jax_triton, launch, inputs, outputs,
                                                    prefix + kernel_name(launch.kernel))

    def lowering(self) -> str:
        return triton_lowering()

    def lowering_available(self, name: str) -> bool:
        return triton_lowering_available(name)

    def use_lowering(self, name: str):
        return use_triton_lowering(name)

    def describe(self) -> dict[str, str]:
        return {"JAX lowering": lowering_reason()}


def install() -> None:
    """Plug the accelerator into the binding."""
    _binding.install(JaxAccelerator())
