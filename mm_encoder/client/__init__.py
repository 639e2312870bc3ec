"""The encoders as other components reach them over the network: the HTTP cache chain first,
Dynamo RPC as the fallback. The frontend asks for headers (`EncoderChain.describe`); engines fetch
bodies by handle (`HandleResolver`), checked against the handle (`core.handle.check_body`)."""

from .chain import EncoderChain, call_encode
from .resolver import HandleResolver, resolve

__all__ = ["EncoderChain", "HandleResolver", "call_encode", "resolve"]
