"""Who a rank is: the cluster's certificate authority, rank certificates and the TLS contexts they make."""

from .certs import Authority, save_rank
from .credentials import Credentials

__all__ = ["Authority", "Credentials", "save_rank"]
