"""broker process package."""
