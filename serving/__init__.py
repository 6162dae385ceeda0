"""The HTTP serving layer shared by ``kvguard engine`` and ``kvguard proxy``: uvicorn with
header/body/idle timeouts and connection caps (``limited_protocol``), or kvguard's own HTTP/1.1
server with the same limits (``h1server``), and quiet logging of client disconnects.

Imports uvicorn and h11 lazily (inside the functions that serve), never torch, ``engine`` or
``guard``; both of those may import it.
"""

from serving.quiet_log import RepeatedLineFilter, install_quiet_logging
from serving.server_limits import ServerLimits, add_limit_arguments, limits_from_args

__all__ = ["RepeatedLineFilter", "ServerLimits", "add_limit_arguments",
           "install_quiet_logging", "limits_from_args"]
