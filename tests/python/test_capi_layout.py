"""The ctypes mirrors of python/odc/_capi.py against the C layout of include/odc/odc.h.

A small C program, compiled here with the system compiler against the header, prints sizeof of
every mirrored struct, offsetof and sizeof of each of its fields, and the value of every mirrored
constant; the fields' names and order come from the header's text. Any drift (a field added, moved, retyped or
renamed on one side only, a constant changed) fails with the differences listed.
"""

import ctypes
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from odc import _capi, comm, errors

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "include" / "odc" / "odc.h"

# C typedef -> its ctypes mirror.
STRUCTS = {
    "odcPlanOptions_t": _capi.PlanOptions,
    "odcBootstrap_t": _capi.Bootstrap,
    "odcCommConfig_t": _capi.CommConfig,
    "odcSimulateRequest_t": _capi.SimulateRequest,
}

# Python value -> the C expression it mirrors.
CONSTANTS = {
    **{
        f"errors.{name}": (getattr(errors, name), c_name)
        for name, c_name in [
            ("SUCCESS", "odcSuccess"),
            ("INVALID_ARGUMENT", "odcInvalidArgument"),
            ("SYSTEM_ERROR", "odcSystemError"),
            ("INTERNAL_ERROR", "odcInternalError"),
            ("INVALID_USAGE", "odcInvalidUsage"),
            ("TIMEOUT", "odcTimeout"),
            ("REMOTE_ERROR", "odcRemoteError"),
            ("INTERRUPTED", "odcInterrupted"),
        ]
    },
    "_capi.FLOAT32": (_capi.FLOAT32, "odcFloat32"),
    "_capi.BFLOAT16": (_capi.BFLOAT16, "odcBfloat16"),
    "_capi.ODC_PLAN_ALL_SAMPLES": (_capi.ODC_PLAN_ALL_SAMPLES, "ODC_PLAN_ALL_SAMPLES"),
    "_capi.PLAN_OPTIONS_MAGIC": (_capi.PLAN_OPTIONS_MAGIC, "ODC_PLAN_OPTIONS_MAGIC"),
    "_capi.PLAN_OPTIONS_VERSION": (_capi.PLAN_OPTIONS_VERSION, "ODC_PLAN_OPTIONS_VERSION"),
    "_capi.SIMULATE_REQUEST_MAGIC": (_capi.SIMULATE_REQUEST_MAGIC, "ODC_SIMULATE_REQUEST_MAGIC"),
    "_capi.SIMULATE_REQUEST_VERSION": (
        _capi.SIMULATE_REQUEST_VERSION,
        "ODC_SIMULATE_REQUEST_VERSION",
    ),
    "_capi.SIMULATE_UNSET": (_capi.SIMULATE_UNSET, "ODC_SIMULATE_UNSET"),
    "_capi.SIMULATE_SFT": (_capi.SIMULATE_SFT, "odcSimulateSft"),
    "_capi.SIMULATE_GRPO": (_capi.SIMULATE_GRPO, "odcSimulateGrpo"),
    "_capi.TRANSPORT_AUTO": (_capi.TRANSPORT_AUTO, "odcTransportAuto"),
    "_capi.TRANSPORT_SHM": (_capi.TRANSPORT_SHM, "odcTransportShm"),
    "_capi.TRANSPORT_CUDA": (_capi.TRANSPORT_CUDA, "odcTransportCuda"),
    "_capi.TRANSPORT_NVSHMEM": (_capi.TRANSPORT_NVSHMEM, "odcTransportNvshmem"),
    "_capi.COMM_CONFIG_VERSION": (_capi.COMM_CONFIG_VERSION, "ODC_COMM_CONFIG_VERSION"),
    "_capi.BOOTSTRAP_VERSION": (_capi.BOOTSTRAP_VERSION, "ODC_BOOTSTRAP_VERSION"),
    "_capi.BYTES_FROM_ENVIRONMENT": (_capi.BYTES_FROM_ENVIRONMENT, "ODC_BYTES_FROM_ENVIRONMENT"),
    "comm._BUFFER_ACCUMULATOR": (comm._BUFFER_ACCUMULATOR, "odcBufferAccumulator"),
    "comm._BUFFER_PUBLISHED": (comm._BUFFER_PUBLISHED, "odcBufferPublished"),
}


def header_fields(text: str, typedef: str) -> list:
    """The field names of `typedef struct { ... } typedef;` in the header, in order."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    match = re.search(r"typedef struct\s*\{([^{}]*)\}\s*" + re.escape(typedef) + r"\s*;", text)
    assert match, f"{typedef} not found in {HEADER}"
    names = []
    for declaration in match.group(1).split(";"):
        if not declaration.strip():
            continue
        pointer = re.search(r"\(\s*\*\s*(\w+)\s*\)", declaration)  # a function pointer
        names.append(pointer.group(1) if pointer else re.findall(r"\w+", declaration)[-1])
    return names


def c_layout(tmp_path: Path, fields: dict) -> dict:
    """{"structs": {typedef: {"size", "offsets": {field: [offset, size]}}}, "constants": {name:
    value}}, computed by C."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        pytest.skip("no C compiler (set CC) to compute the C layout with")
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "odc/odc.h"',
        "int main(void) {",
    ]
    lines.append('  printf("{\\"structs\\": {");')
    for index, (typedef, names) in enumerate(fields.items()):
        offsets = ", ".join(f'\\"{n}\\": [%zu, %zu]' for n in names)
        arguments = "".join(
            f", offsetof({typedef}, {n}), sizeof((({typedef}*)0)->{n})" for n in names
        )
        comma = ", " if index else ""
        lines.append(
            f'  printf("{comma}\\"{typedef}\\": {{\\"size\\": %zu, \\"offsets\\": {{{offsets}}}}}"'
            f", sizeof({typedef}){arguments});"
        )
    lines.append('  printf("}, \\"constants\\": {");')
    for index, (name, (_, expression)) in enumerate(CONSTANTS.items()):
        comma = ", " if index else ""
        lines.append(f'  printf("{comma}\\"{name}\\": %llu", (unsigned long long)({expression}));')
    lines.append('  printf("}}\\n");\n  return 0;\n}')
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    binary = tmp_path / "layout"
    subprocess.run(
        [compiler, "-std=c11", "-I", str(REPO / "include"), str(source), "-o", str(binary)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(subprocess.run([str(binary)], check=True, capture_output=True).stdout)


def test_ctypes_mirrors_match_the_c_layout(tmp_path):
    text = HEADER.read_text()
    fields = {typedef: header_fields(text, typedef) for typedef in STRUCTS}
    layout = c_layout(tmp_path, fields)
    drift = []
    for typedef, mirror in STRUCTS.items():
        mirror_names = [name for name, _ in mirror._fields_]
        if mirror_names != fields[typedef]:
            drift.append(f"{typedef}: fields {fields[typedef]} in C, {mirror_names} in ctypes")
        c = layout["structs"][typedef]
        if ctypes.sizeof(mirror) != c["size"]:
            drift.append(f"{typedef}: sizeof {c['size']} in C, {ctypes.sizeof(mirror)} in ctypes")
        for name, (offset, size) in c["offsets"].items():
            field = getattr(mirror, name, None)
            if field is None or (field.offset, field.size) != (offset, size):
                found = "missing" if field is None else f"{field.offset} (size {field.size})"
                drift.append(
                    f"{typedef}.{name}: offset {offset} (size {size}) in C, {found} in ctypes"
                )
    for name, (value, expression) in CONSTANTS.items():
        c_value = layout["constants"][name]
        if value % 2**64 != c_value:
            drift.append(f"{name} = {value}, but {expression} = {c_value} in C")
    assert not drift, "ctypes mirrors drifted from include/odc/odc.h:\n  " + "\n  ".join(drift)


def test_header_parser_reads_function_pointers_and_appended_fields():
    """The parser the layout test relies on, on a struct like odcBootstrap_t."""
    text = """typedef struct {
      unsigned int version; /* a; b */
      int (*allgather)(void* ctx, const void* send, void* recv, size_t bytes);
      size_t tail;
    } demo_t;"""
    assert header_fields(text, "demo_t") == ["version", "allgather", "tail"]
