"""Host TMA descriptors for the Gluon kernels (``decode_v3.py``, ``prefill_rs.py``), made cheaply.

An eager MoE call makes four (decode) to six (prefill) descriptors, and its host time is what an
eager ``generate()`` waits on (benchmarks/NOTES.md, "Host time of an eager call"). Gluon's
``TensorDescriptor.from_tensor`` with a new ``NVMMASharedLayout`` took ~7 us a descriptor on a CPU,
half of it building and checking the layout, half checking the descriptor, and the weights' views
the kernels read (3-4 torch view ops each) as much again. Here:

* a layout is made once per kind (:func:`shared_layout`);
* :func:`descriptor`: a descriptor whose geometry (dtype, shape, strides, box, layout, and whether
  its address is 16-byte aligned) Gluon checked once is copied from the first one made, its base
  swapped: Gluon's checks depend on nothing else, so they would pass again;
* :func:`view_descriptor`: the descriptor of a view of a whole tensor (a weight in the kernels'
  view, or a prefill's activations by K step) is copied the same way from the tensor's own
  geometry, without making the view again: its base is then the tensor itself in the view's
  dtype. That base has the view's address and dtype, all a launch reads of it (the shape and
  strides are the descriptor's own).
"""

from __future__ import annotations

from functools import lru_cache

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# geometry -> the fields of a descriptor Gluon made and checked with it, all but its base (a cache
# that held the base would keep that tensor's memory alive: the first weight or activation seen)
_CHECKED: dict = {}
_CHECKED_MAX = 4096  # (prefill activations add one per token count: dropped all at once past this)


@lru_cache(maxsize=None)
def shared_layout(swizzle: int, bits: int, rank: int):
    """The NVMMA shared layout of a TMA box (a frozen dataclass: one object per kind)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=bits, rank=rank)


def descriptor(view, box: list[int], swizzle: int = 0) -> TensorDescriptor:
    """Gluon's ``TensorDescriptor.from_tensor(view, box, layout)``, with the NVMMA layout of
    ``swizzle`` bytes for ``view``'s element size and rank."""
    layout = shared_layout(swizzle, 8 * view.element_size(), view.dim())
    geometry = (view.dtype, view.shape, view.stride(), *box, id(layout), not view.data_ptr() & 15)
    template = _CHECKED.get(geometry)
    if template is None:
        made = TensorDescriptor.from_tensor(view, box, layout)  # Gluon's checks
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        if hasattr(made, "__dict__"):
            _CHECKED[geometry] = _fields(made)
        return made
    return _copy(template, view)


def _copy(fields: dict, base) -> TensorDescriptor:
    """A descriptor with ``fields`` (:func:`_fields`) and ``base``, without Gluon's checks."""
    made = object.__new__(TensorDescriptor)
    made.__dict__.update(fields, base=base)
    return made


def _fields(made: TensorDescriptor) -> dict:
    # (the block shape copied: the caller's list, were it changed later, would change every copy)
    return {name: list(value) if name == "block_shape" else value for name, value in made.__dict__.items()
            if name != "base"}


# (view function, its arguments, box, the tensor's geometry) -> (the view's dtype, its descriptor's
# fields but the base)
_VIEWED: dict = {}


def view_descriptor(make_view, tensor, box: list[int], *view_args, swizzle: int = 0) -> TensorDescriptor:
    """:func:`descriptor` of ``make_view(tensor, *view_args)``, a view of all of ``tensor``
    starting where it starts (``make_view`` a module-level function); the view is made once per
    geometry of ``tensor`` (see the module docstring; activations add a geometry per token count,
    bounded as :func:`descriptor`'s)."""
    geometry = (make_view, view_args, tensor.dtype, tensor.shape, tensor.stride(), *box, swizzle,
                not tensor.data_ptr() & 15)
    template = _VIEWED.get(geometry)
    if template is None:
        view = make_view(tensor, *view_args)
        made = descriptor(view, box, swizzle)
        if view.data_ptr() == tensor.data_ptr() and hasattr(made, "__dict__") and _views_as(tensor, view.dtype):
            if len(_VIEWED) >= _CHECKED_MAX:
                _VIEWED.clear()
            _VIEWED[geometry] = (view.dtype, _fields(made))
        return made
    dtype, fields = template
    return _copy(fields, tensor if tensor.dtype == dtype else tensor.view(dtype))


def _views_as(tensor, dtype) -> bool:
    """Whether ``tensor.view(dtype)`` (a copy's base) works: a view function may reach the view's
    dtype after a reshape that the tensor itself could not take."""
    try:
        return tensor.view(dtype).data_ptr() == tensor.data_ptr()
    except RuntimeError:
        return False
