"""actors process package."""
