"""The case file of an incident: its logged facts, the notification of each party and the
decision register (GDPR Art. 33(2), 33(5)), and the signed bundle that carries them."""
