// The AudioWorklet side of the player: a jitter buffer that starts playing once `prebuffer` samples are queued (or
// the stream's last audio arrived), counts an underrun when it runs dry while more audio is due, and reports what it
// played so the page can show it and tell the server how much was heard.
class JitterBuffer extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.prebuffer = options.processorOptions.prebufferSamples;
    this.chunks = [];
    this.offset = 0; // into chunks[0]
    this.buffered = 0;
    this.playing = false;
    this.ended = true; // no audio is due: running dry now is not an underrun
    this.played = 0;
    this.underruns = 0;
    this.quanta = 0;
    this.port.onmessage = (event) => this.command(event.data);
  }

  command(message) {
    if (message.type === "audio") {
      this.chunks.push(message.samples);
      this.buffered += message.samples.length;
      this.ended = false;
    } else if (message.type === "end") {
      this.ended = true;
    } else if (message.type === "clear") {
      this.chunks = [];
      this.offset = 0;
      this.buffered = 0;
      this.playing = false;
      this.ended = true;
      this.report();
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let written = 0;
    if (!this.playing && this.buffered > 0 && (this.buffered >= this.prebuffer || this.ended)) this.playing = true;
    while (this.playing && written < out.length && this.chunks.length) {
      const chunk = this.chunks[0];
      const n = Math.min(out.length - written, chunk.length - this.offset);
      out.set(chunk.subarray(this.offset, this.offset + n), written);
      written += n;
      this.offset += n;
      this.buffered -= n;
      if (this.offset === chunk.length) {
        this.chunks.shift();
        this.offset = 0;
      }
    }
    this.played += written;
    out.fill(0, written);
    if (this.playing && this.buffered === 0) {
      this.playing = false;
      if (!this.ended) this.underruns += 1; // ran dry while the stream goes on: refill to `prebuffer` first
    }
    if (++this.quanta % 16 === 0) this.report();
    return true;
  }

  report() {
    this.port.postMessage({played: this.played, underruns: this.underruns, buffered: this.buffered,
                           playing: this.playing});
  }
}

registerProcessor("jitter-buffer", JitterBuffer);
