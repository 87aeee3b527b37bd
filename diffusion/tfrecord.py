"""img2dataset's tfrecord output, read without TensorFlow.

img2dataset's output_format=tfrecord: records of a tf.train.Example each, with features key, jpg, txt
and the metadata (status, width, ...). Read without TensorFlow: a record is its length (uint64), a
CRC of the length, the serialized Example and a CRC of it (the CRCs are not checked: a damaged
record fails to parse or to decode); the Example is decoded with the protobuf wire format's rules.
"""

from __future__ import annotations

from typing import Iterator


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a varint runs past the end of its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one protobuf message: an int for a varint,
    bytes for the others."""
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire in (1, 2, 5):
            if wire == 2:
                size, pos = _varint(buf, pos)
            else:
                size = 8 if wire == 1 else 4
            value = buf[pos:pos + size]
            if len(value) != size:
                raise ValueError("a field runs past the end of its message")
            pos += size
        else:
            raise ValueError(f"wire type {wire} is not used by tf.train.Example")
        yield number, wire, value


def _feature_values(feature: bytes) -> list:
    """The values of one tf.train.Feature: bytes (BytesList), floats (FloatList) or ints (Int64List)."""
    import struct
    values = []
    for kind, wire, body in _fields(feature):
        if wire != 2 or kind not in (1, 2, 3):
            continue
        for number, wire, value in _fields(body):
            if number != 1:
                continue
            if kind == 1 and wire == 2:
                values.append(bytes(value))
            elif kind == 2:
                values.extend(struct.unpack(f"<{len(value) // 4}f", value) if wire in (2, 5) else ())
            elif kind == 3 and wire == 0:
                values.append(value - (1 << 64) if value >= 1 << 63 else value)
            elif kind == 3 and wire == 2:  # packed
                pos = 0
                while pos < len(value):
                    v, pos = _varint(value, pos)
                    values.append(v - (1 << 64) if v >= 1 << 63 else v)
    return values


def example_features(record: bytes) -> dict[str, list]:
    """{feature name: values} of a serialized tf.train.Example; ValueError if it is not one."""
    features = {}
    for number, wire, body in _fields(record):
        if number != 1 or wire != 2:  # Example.features
            continue
        for number, wire, entry in _fields(body):
            if number != 1 or wire != 2:  # Features.feature, a map: entries of (key = 1, value = 2)
                continue
            name, feature = b"", b""
            for field, field_wire, value in _fields(entry):
                if field_wire == 2 and field == 1:
                    name = bytes(value)
                elif field_wire == 2 and field == 2:
                    feature = bytes(value)
            features[name.decode("utf-8", "replace")] = _feature_values(feature)
    return features
