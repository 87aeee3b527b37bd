"""TFRecord files of tf.train.Example records, as img2dataset's tfrecord writer makes them, without
TensorFlow: the Example messages are built with protobuf's own library from a descriptor of
tensorflow/core/example/{example,feature}.proto, and framed with masked CRC32C (crc32c), so the
converter's reader, which decodes both by hand, is checked against independent encoders."""

import struct

import crc32c
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto


def _example_class():
    proto = descriptor_pb2.FileDescriptorProto(name="tf_example_for_tests.proto", package="tensorflow",
                                               syntax="proto3")

    def message(name, *fields, nested=None, oneof=None):
        m = proto.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for number, (field, kind, type_name, label) in enumerate(fields, 1):
            f = m.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                f.type_name = type_name
            if oneof:
                f.oneof_index = 0
            if kind in (_F.TYPE_FLOAT, _F.TYPE_INT64):
                f.options.packed = True
        if nested:
            entry = m.nested_type.add(name=nested[0])
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=_F.TYPE_MESSAGE, label=_F.LABEL_OPTIONAL, type_name=nested[1])
        return m

    rep, opt = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL
    message("BytesList", ("value", _F.TYPE_BYTES, None, rep))
    message("FloatList", ("value", _F.TYPE_FLOAT, None, rep))
    message("Int64List", ("value", _F.TYPE_INT64, None, rep))
    message("Feature", ("bytes_list", _F.TYPE_MESSAGE, ".tensorflow.BytesList", opt),
            ("float_list", _F.TYPE_MESSAGE, ".tensorflow.FloatList", opt),
            ("int64_list", _F.TYPE_MESSAGE, ".tensorflow.Int64List", opt), oneof="kind")
    message("Features", ("feature", _F.TYPE_MESSAGE, ".tensorflow.Features.FeatureEntry", rep),
            nested=("FeatureEntry", ".tensorflow.Feature"))
    message("Example", ("features", _F.TYPE_MESSAGE, ".tensorflow.Features", opt))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


Example = _example_class()


def example(features: dict) -> bytes:
    """A serialized Example: str/bytes values as BytesList, ints as Int64List, floats as FloatList;
    None as b"" (as img2dataset writes a missing value)."""
    ex = Example()
    for name, value in features.items():
        feature = ex.features.feature[name]
        if isinstance(value, bool) or value is None or isinstance(value, (str, bytes)):
            value = b"" if value is None else value
            feature.bytes_list.value.append(value.encode() if isinstance(value, str) else value)
        elif isinstance(value, int):
            feature.int64_list.value.append(value)
        else:
            feature.float_list.value.append(value)
    return ex.SerializeToString()


def _masked_crc(data: bytes) -> int:
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def write_tfrecord(path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for data in records:
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data)))
