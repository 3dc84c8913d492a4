"""Codecs that compress the activations `hifigrad.checkpoint` and `hifigrad.scan` save.

A codec stores ``enc = codec.encode(x)`` in the forward pass instead of the activation ``x`` and
gives back ``codec.decode(enc, x.dtype)`` when the backward pass needs it. Pass a codec object or
its name (`get_codec` lists the names: ``none``, ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``, their
per-row variants, ``int8``, ``int4``, ``int2``) as ``codec=``. Every codec is pure JAX with static
shapes: it works eagerly, under `jax.jit`, `jax.vmap` and inside `jax.lax.scan`.

This module is importable on its own (``import hifigrad.codecs``, ``from hifigrad.codecs import
IntCodec``) and is also ``hifigrad.codecs``.
"""

from ._src.codecs import BF16Codec as BF16Codec
from ._src.codecs import Codec as Codec
from ._src.codecs import DelayedFP8Codec as DelayedFP8Codec
from ._src.codecs import Encoded as Encoded
from ._src.codecs import FP8Codec as FP8Codec
from ._src.codecs import IntCodec as IntCodec
from ._src.codecs import NoneCodec as NoneCodec
from ._src.codecs import get_codec as get_codec

__all__ = [
    "BF16Codec",
    "Codec",
    "DelayedFP8Codec",
    "Encoded",
    "FP8Codec",
    "IntCodec",
    "NoneCodec",
    "get_codec",
]
