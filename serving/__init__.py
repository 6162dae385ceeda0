"""The HTTP serving layer shared by ``kvguard engine`` and ``kvguard proxy``: uvicorn with
header/body/idle timeouts and connection caps, and quiet logging of client disconnects.

Imports uvicorn and h11 lazily (inside the functions that serve), never torch, ``engine`` or
``guard``; both of those may import it.
"""

from serving.disconnect_log import SendErrorLogFilter, install_send_error_filter
from serving.server_limits import ServerLimits, add_limit_arguments, limits_from_args

__all__ = ["SendErrorLogFilter", "ServerLimits", "add_limit_arguments",
           "install_send_error_filter", "limits_from_args"]
