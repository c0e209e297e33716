"""The bus: NATS as Tandem uses it.

Owns the connection (request/reply, publish, subscribe, JetStream), the service framework
(micro endpoints with typed requests and error replies) and the KV-event stream
(`tandem.kv.events.<id>` and its JetStream stream), and who may use which subject: a
service's NATS identity (credentials.py) and each role's allow lists (permissions.py).

May import: libs.common.config, libs.common.log, libs.common.tracing, libs.common.messages,
libs.common.engine.core (page-event types). Never torch, the transfer engine or a service.
"""
