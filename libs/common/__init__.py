"""Tandem's shared library, organised by concern (docs/architecture.md maps it).

Loose modules: config (flags), log (structlog), tracing (OpenTelemetry), event_loop, service
(the service base).
Packages: messages, engine (load, core, model), bus, transfer, pool, worker. Each
package's docstring says what it owns and what it may import.
"""

__version__ = "0.1.0"
