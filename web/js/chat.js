// The /v1/chat socket: the server streams a reply from its LLM, shows it here piece by piece (chat.delta) and
// speaks it into a context of our voxgate.v1 session as it arrives.
export class ChatSocket {
  // handlers: onDelta(id, text), onDone(id, text, reason), onError(message)
  constructor(url, handlers) {
    this.handlers = handlers;
    this.ws = new WebSocket(url);
    this.ready = new Promise((resolve, reject) => {
      this.ws.onerror = () => reject(new Error("the chat socket failed"));
      this.ws.onclose = (event) => {
        reject(new Error(`the chat socket closed (${event.code} ${event.reason})`));
        handlers.onError({code: "closed", message: `the chat socket closed (${event.code})`});
      };
      this.ws.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "chat.ready") resolve(message);
        else if (message.type === "chat.delta") handlers.onDelta(message.id, message.text);
        else if (message.type === "chat.done") handlers.onDone(message.id, message.text, message.reason);
        else if (message.type === "error") handlers.onError(message);
      };
    });
  }

  request(fields) {
    this.ws.send(JSON.stringify({type: "chat.request", ...fields}));
  }

  cancel(id) {
    this.ws.send(JSON.stringify({type: "chat.cancel", id}));
  }
}
