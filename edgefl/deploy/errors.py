"""The error of a deployment step that cannot proceed; its message names the fix."""

from edgefl.errors import EdgeFLError


class DeployError(EdgeFLError):
    """Deployment input or state is wrong (missing file, port in use, ...); say how to fix it."""
