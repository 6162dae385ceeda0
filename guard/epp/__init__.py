"""``kvguard epp``: kvguard as the endpoint picker (EPP) of Envoy and the Gateway API.

Envoy's ``ext_proc`` filter streams each request here; the
:class:`~guard.controller.AdmissionController` decides (this is its third adapter, beside the
ASGI middleware and the proxy) and the answer names the replica Envoy sends it to, or is the
429/503 Envoy answers with. Modules:

* :mod:`guard.epp.picker`: the director, plain calls per request (no protobuf);
* :mod:`guard.epp.messages`: Envoy's protobuf messages ↔ plain values;
* :mod:`guard.epp.processor`: the gRPC stream loop, a translator between the two;
* :mod:`guard.epp.server`: the gRPC server, health and drain; :mod:`guard.epp.cli`: the command.

Only ``picker`` imports nothing beyond the guard's core dependencies; the others need the
``gateway`` extra (grpcio, grpcio-health-checking, protobuf, xds-protos), so importing this
package imports none of them.
"""

from guard.epp.picker import EndpointPicker, PickerExchange, Route, endpoint_of_url

__all__ = ["EndpointPicker", "PickerExchange", "Route", "endpoint_of_url"]
