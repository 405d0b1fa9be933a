"""Who runs where: roles of the ranks (trainer / rollout), the nodes they are on, where the
Parameter Server's pieces live, and the sockets that join several nodes.
"""
