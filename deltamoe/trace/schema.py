"""The part of the Kineto format the analyzer reads, as msgspec Structs.

Decoding into these types skips every key not listed without building Python objects for
it (kernel events carry ~15 args of which 3 matter), which makes parsing several times
faster than materialising whole dicts. Values whose type varies between PyTorch versions
are `Any`, so an unusual trace costs nothing but a missing field, never a failed rank.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Args(msgspec.Struct, gc=False, rename={
    "external_id": "External id", "collective": "Collective name", "pg_name": "Process Group Name",
    "seq": "Seq", "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems", "src": "Src Rank",
    "dst": "Dst Rank", "concrete_inputs": "Concrete Inputs"}):  # gc=False: no cycles, cheaper
    external_id: Any = None
    correlation: Any = None
    stream: Any = None
    collective: Any = None
    pg_name: Any = None
    seq: Any = None
    in_nelems: Any = None
    out_nelems: Any = None
    dtype: Any = None
    src: Any = None
    dst: Any = None
    concrete_inputs: Any = None

    def collective_args(self) -> dict:
        """The collective fields under their Kineto names (what build.py looks up)."""
        out = {}
        for attr, key in _COLL_KEYS:
            v = getattr(self, attr)
            if v is not None:
                out[key] = v
        return out


_COLL_KEYS = (("collective", "Collective name"), ("pg_name", "Process Group Name"), ("seq", "Seq"),
              ("in_nelems", "In msg nelems"), ("out_nelems", "Out msg nelems"), ("dtype", "dtype"),
              ("src", "Src Rank"), ("dst", "Dst Rank"))


class Event(msgspec.Struct, gc=False):
    ph: Any = None
    cat: Any = None
    name: Any = ""
    tid: Any = 0
    ts: Any = None
    dur: Any = None
    args: Args | None = None


class Trace(msgspec.Struct):
    traceEvents: list[Event] | None = None  # noqa: N815 (the Kineto key)
    distributedInfo: Any = None  # noqa: N815
    host_name: Any = None

    def header(self) -> dict:
        return {"distributedInfo": self.distributedInfo, "host_name": self.host_name or ""}


TRACE = msgspec.json.Decoder(Trace)
EVENTS = msgspec.json.Decoder(list[Event])
DecodeError = msgspec.DecodeError
