"""Producers of quantized checkpoints, one folder each, and their one registry.

A producer folder holds everything about one producer: reading its config (``config``),
assigning modules their schemes from it (``detect``), writing its config (``write_config``) and
its quantization arithmetic (``arithmetic``), tied together by a ``Producer`` in its
``__init__`` (see ``base.Producer``). The loader (``checkpoint.config``, ``checkpoint.detect``)
and the writer (``writing.producer_config``, ``quantize.weight``) iterate ``PRODUCERS`` and name
no producer. Adding a producer means adding a folder, its YAML schemes, and one line below (its
``detect.<name>`` rule in descriptors is its folder's ``RuleSchema``, registered here).

Order matters where producers compete: a producer's own file (ModelOpt's hf_quant_config.json)
is looked for in this order, and the first producer that ``writes`` a scheme writes it
(self-described last: it writes any scheme).

Nothing here imports the loader, the writer, parallel/ or transformers/ (tests/test_producers.py
checks); what producers share is in ``base``.
"""

from __future__ import annotations

from qscheme.descriptor.rules import RuleSchema, register_rule_schema
from qscheme.producers import (
    auto_round,
    awq,
    bitsandbytes,
    compressed_tensors,
    fp8,
    gptq,
    modelopt,
    mxfp4,
    self_described,
)
from qscheme.producers.base import Producer, ProducerConfig
from qscheme.producers.gguf import rule as _gguf_rule

PRODUCERS: tuple[Producer, ...] = (
    compressed_tensors.PRODUCER,
    modelopt.PRODUCER,
    mxfp4.PRODUCER,
    gptq.PRODUCER,
    awq.PRODUCER,
    auto_round.PRODUCER,
    fp8.PRODUCER,
    bitsandbytes.PRODUCER,
    self_described.PRODUCER,
)

# GGUF files describe themselves (each tensor's ggml type), so the GGUF producer reads no config
# and has no ``Producer`` entry: the loader reaches it through the container (``checkpoint.plan``
# sends a .gguf path to ``checkpoint.gguf_plan``). Its detect rule and arithmetic are registered
# with the others' below.
RULE_SCHEMAS: tuple[RuleSchema, ...] = (
    *(producer.rule_schema for producer in PRODUCERS if producer.rule_schema is not None),
    _gguf_rule.RULE_SCHEMA,
)
ARITHMETIC_MODULES: tuple[str, ...] = (
    *(producer.arithmetic for producer in PRODUCERS if producer.arithmetic is not None),
    "qscheme.producers.gguf.arithmetic",
)
"""Every producer's quantization arithmetic, by module name (imported by ``quantize.weight``,
which registers them; naming them keeps this package torch-free)."""

# Each producer's detect rule, handed to the descriptor's parser (``descriptor.rules``): the
# descriptor names no producer. The top package ``qscheme`` imports this package, so the rules are
# registered before any descriptor is parsed.
for _schema in RULE_SCHEMAS:
    register_rule_schema(_schema)


def producer_of_config(config: ProducerConfig) -> Producer:
    """The producer whose reader returned ``config``."""
    for producer in PRODUCERS:
        if isinstance(config, producer.config_type):
            return producer
    raise TypeError(f"no producer reads configs of type {type(config).__name__}")


__all__ = ["ARITHMETIC_MODULES", "PRODUCERS", "RULE_SCHEMAS", "Producer", "ProducerConfig", "producer_of_config"]
