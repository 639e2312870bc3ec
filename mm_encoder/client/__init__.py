"""The encoders as other components reach them over the network: the HTTP cache chain first,
Dynamo RPC as the fallback. The frontend asks for headers (`EncoderChain.describe`); engines fetch
bodies by handle (`HandleResolver.fetch`) and check each decoded body against its handle
(`core.handle.check_header`)."""

from .chain import EncoderChain, call_encode
from .resolver import HandleResolver

__all__ = ["EncoderChain", "HandleResolver", "call_encode"]
