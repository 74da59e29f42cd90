"""learner process package."""
