"""The atomlog Python SDK (and, later, the Spark data source built on it).

    from spark_client import Client
    client = Client("127.0.0.1:7001")
    client.create_topic("orders", partitions=8)
    with client.producer() as producer:
        producer.send("orders", b"hello", key=b"k").result(10)
    with client.consumer("orders") as consumer:
        for message in consumer.poll(timeout_s=1.0):
            ...

A cluster serving mutual TLS: `Client("host:port", tls=TlsConfig(ca_file="ca.crt",
cert_file="client.crt", key_file="client.key"))`.
"""

from services.tls import TlsConfig
from spark_client.client import Client

__all__ = ["Client", "TlsConfig"]
