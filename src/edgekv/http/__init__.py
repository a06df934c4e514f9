"""What EdgeKV's two HTTP servers share, the OpenAI server (`serve`) and the KV server
(`kvserver`): the listening socket and uvicorn as both run it (`binding`), and the answer to a
client that hung up (`errors`). Neither server imports the other."""
