"""OTLP/HTTP trace ingest (``POST /v1/traces``): OpenTelemetry GenAI spans become request
records, through the same store, idempotency and policies as ``POST /v1/events``.

- :mod:`collector.otlp.wire`: an export request's bytes (protobuf or JSON, maybe gzip) →
  :class:`~collector.otlp.wire.Span` views, one shape for both encodings;
- :mod:`collector.otlp.genai`: the GenAI semantic conventions, a span → request events;
- :mod:`collector.otlp.service`: one export request stored whole, with OTLP's partial
  success for the spans it refuses.
"""
