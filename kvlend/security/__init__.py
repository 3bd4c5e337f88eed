"""Who a rank is: the cluster's certificate authority, rank certificates and the TLS contexts they make."""

from .credentials import Credentials
from .certs import Authority, save_rank

__all__ = ["Authority", "Credentials", "save_rank"]
