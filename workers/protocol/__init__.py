"""The attempt protocol both lines share: lease, heartbeat, fence, kept result and report, failure classes."""
