"""TLS on every HTTP hop: the deployment's CA and certificates (pki.py), SSL contexts and who may call whom (tls.py)."""
