"""Site profiles: how xffl reaches a facility, launches training ranks there, and where it works."""
