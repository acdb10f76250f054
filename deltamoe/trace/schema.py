"""The part of the Kineto format the analyzer reads, as msgspec Structs.

Decoding into these types skips every key not listed without building Python objects for
it (kernel events carry ~15 args of which 3 matter), which makes parsing several times
faster than materialising whole dicts. Values whose type varies between PyTorch versions
are `Any`, so an unusual trace costs nothing but a missing field, never a failed rank.

Events are a union tagged by `ph`: only complete events ("X") have fields; flow arrows,
metadata, instants and counters (a third of a Kineto trace, none of them used) decode to
empty placeholders, which is ~20% faster than reading their fields. A phase outside the
Chrome trace format fails the tagged decode, and such a file is decoded again generically.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


NO_RAW = msgspec.Raw()

_RAW_ARGS = ("Input Dims", "Input type")


class Args(msgspec.Struct, gc=False, rename={
    "external_id": "External id", "collective": "Collective name", "pg_name": "Process Group Name",
    "seq": "Seq", "in_nelems": "In msg nelems", "out_nelems": "Out msg nelems", "src": "Src Rank",
    "dst": "Dst Rank", "concrete_inputs": "Concrete Inputs", "pg_ranks": "Process Group Ranks",
    "rank_start": "Global rank start", "rank_stride": "Global rank stride", "group_size": "Group size",
    "input_dims": "Input Dims", "input_type": "Input type"}):  # gc=False: no cycles, cheaper
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
    pg_ranks: Any = None      # "[1, 13, 25, 37]": the group's global ranks (truncated beyond 30)
    rank_start: Any = None    # first global rank of a strided group
    rank_stride: Any = None
    group_size: Any = None
    # record_shapes: the shapes and dtypes of an op's inputs, on every op; kept undecoded (a
    # slice of the file) and decoded only for the few collective calls (gloo payloads).
    input_dims: msgspec.Raw = NO_RAW
    input_type: msgspec.Raw = NO_RAW


NO_ARGS = Args()


class Event(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    """A complete event: the only phase the analyzer reads."""

    cat: Any = None
    name: Any = ""
    tid: Any = 0
    ts: Any = None
    dur: Any = None
    args: Args | None = None


# Every other phase of the Chrome trace format (B/E durations, instants, counters, async,
# flows, objects, metadata, marks, memory dumps, contexts), as a field-less placeholder.
_OTHER_PHASES = tuple(msgspec.defstruct(f"Phase{ord(p)}", [], tag_field="ph", tag=p, gc=False)
                      for p in "BEiICbnestfPONDMRcVv()")
AnyEvent = Union[(Event, *_OTHER_PHASES)]  # noqa: UP007 (a runtime union of a tuple)


class Trace(msgspec.Struct):
    traceEvents: list[AnyEvent] | None = None  # noqa: N815 (the Kineto key)
    distributedInfo: Any = None  # noqa: N815
    host_name: Any = None
    profiler_step_offset: Any = None  # training step of ProfilerStep#0, where the recorder says

    def header(self) -> dict:
        return {"distributedInfo": self.distributedInfo, "host_name": self.host_name or "",
                "profiler_step_offset": self.profiler_step_offset}


_TRACE = msgspec.json.Decoder(Trace)
_EVENTS = msgspec.json.Decoder(list[AnyEvent])
DecodeError = msgspec.DecodeError


def decode_trace(data: bytes) -> Trace:
    """The whole document; raises DecodeError for malformed JSON or a malformed event."""
    try:
        return _TRACE.decode(data)
    except msgspec.ValidationError:
        doc = msgspec.json.decode(data)
        if not isinstance(doc, dict):
            raise
        events = doc.get("traceEvents")
        return Trace(None if events is None else _complete_events(events),
                     doc.get("distributedInfo"), doc.get("host_name"), doc.get("profiler_step_offset"))


def decode_events(data: bytes) -> list:
    """A JSON array of events (a slice of a large file)."""
    try:
        return _EVENTS.decode(data)
    except msgspec.ValidationError:
        return _complete_events(msgspec.json.decode(data))


def _complete_events(events: object) -> list:
    """Generic fallback: complete events converted, any other entry kept as None (counted)."""
    if not isinstance(events, list):
        raise msgspec.ValidationError("traceEvents is not an array")
    return [msgspec.convert(_raw_args(e), Event) if isinstance(e, dict) and e.get("ph") == "X" else None
            for e in events]


def _raw_args(e: dict) -> dict:
    """The args kept undecoded (`Args.input_dims`) re-encoded, as convert expects raw JSON there."""
    a = e.get("args")
    if not isinstance(a, dict) or not any(k in a for k in _RAW_ARGS):
        return e
    return {**e, "args": {**a, **{k: msgspec.Raw(msgspec.json.encode(a[k])) for k in _RAW_ARGS if k in a}}}
