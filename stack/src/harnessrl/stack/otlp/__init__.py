"""`harnessrl otlp`: every LLM-call span sent once to an OpenTelemetry backend over OTLP/HTTP.

A durable JetStream consumer on SPANS (one run's spans, or every run's) hands each span to the
exporter, which POSTs it as a protobuf `ExportTraceServiceRequest` to `<endpoint>/v1/traces` and
returns only after a 2xx: the bus acknowledges a span once the backend has it, and a restart goes
on from the consumer's position on the server (`--consumer` names it). A span is a CLIENT span
following the OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.usage.input_tokens`, ...), timed by the call's own start and
latency, with the RL facts in the `harnessrl.` namespace (run, episode, policy version, seq).

One trace per episode: the trace id is a hash of the run and episode, the span id a hash of the
gateway's span id, so a span sent twice (an ack lost after the POST) is the same span to the backend.

Prompt and completion contents stay out unless `include_content` (`--include-content`): then the
completions' text goes in `gen_ai.output.messages` and the token ids in `harnessrl.` attributes. The
gateway keeps no prompt text (the conversation is on the bus as delta-encoded token ids), so the
prompt goes in `gen_ai.input.messages` only with the policy's tokenizer (`--tokenizer`): each
prompt is rebuilt from its parent's context and decoded, the chat template included.

Nothing is dropped silently. A backend that is down, times out or answers 429/502/503/504 is retried
with exponential backoff (its `Retry-After` honoured), one attempt at a time, for as long as it
takes: `harnessrl_otlp_export_failures_total{reason}`. A span the backend refuses for good (another
status, rejected spans in a partial success) or that is no valid span is logged, counted in
`harnessrl_otlp_spans_refused_total{reason}` and dead-lettered (`hrl.dlq.hrl.span...`).
"""

from harnessrl.stack.otlp.command import cmd_otlp, register
from harnessrl.stack.otlp.consumer import counts, export_spans, run_export
from harnessrl.stack.otlp.options import TRACES_PATH, OtlpError, OtlpOptions
from harnessrl.stack.otlp.sending import OtlpMetrics, PromptText, load_tokenizer
from harnessrl.stack.otlp.spans import span_id, trace_id

__all__ = [
    "TRACES_PATH",
    "OtlpError",
    "OtlpMetrics",
    "OtlpOptions",
    "PromptText",
    "cmd_otlp",
    "counts",
    "export_spans",
    "load_tokenizer",
    "register",
    "run_export",
    "span_id",
    "trace_id",
]
